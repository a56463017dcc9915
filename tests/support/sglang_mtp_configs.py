"""Read MTP / NextN configs with SGLang 0.5.23's own code, in the SGLang reference venv, for
tests/unit/draft/test_mtp_checks.py to hold helpers/draft/mtp_checks.py against (an independent reading: nothing of
helpers/ is imported here).

Usage (env/reference/.venv/bin/python, SGLANG_USE_CPU_ENGINE=1): sglang_mtp_configs.py JOBS.json OUT.json; JOBS is a
list of ``{"name", "folder"}``. OUT gets ``{name: {...}}`` with ``head_class`` and ``layers``: the draft's
``architectures[0]`` and ``num_nextn_predict_layers`` after ``ModelConfig(folder, is_draft_model=True)``
(``configs/model_config.py::ModelConfig._config_draft_model``), and, for the DeepSeek / GLM families, ``prefix`` (the
checkpoint prefix SGLang's loader reads) or ``refused`` (its exception, ``type: text``) from
``models/deepseek_common/deepseek_weight_loader.py::DeepseekV2WeightLoaderMixin._initialize_nextn_conf`` called on that
config (it reads ``self.config`` only). For ``Step3p5MTP``: ``single_layer_load``, the exception
``Step3p5MTP.load_weights`` raises on the head's first tensor with ``draft_model_idx`` None (one head model, no
multi-layer EAGLE: ``managers/tp_worker.py`` l. 498), ``type: text``. For ``MiMoV2MTP``: ``step1_reads``, the names
``model_loader/loader.py::DefaultModelLoader._filter_mtp_weights`` keeps for draft model 1 (multi-layer EAGLE) of
``model.mtp.layers.{0,1,2}.enorm.weight``."""
import json
import sys
from types import SimpleNamespace

import torch
from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.model_loader.loader import DefaultModelLoader
from sglang.srt.models.step3p5_mtp import Step3p5MTP
from torch import nn
from sglang.srt.models.deepseek_common.deepseek_weight_loader import DeepseekV2WeightLoaderMixin


def one(job):
    draft = ModelConfig(job["folder"], trust_remote_code=False, is_draft_model=True)
    cfg = draft.hf_config
    out = {"head_class": cfg.architectures[0], "layers": getattr(cfg, "num_nextn_predict_layers", None)}
    # Glm4MoeLiteForCausalLM.load_weights (glm4_moe_lite.py l. 834-900) repeats the mixin's rule line for line
    if out["head_class"] in ("DeepseekV3ForCausalLMNextN", "Glm4MoeForCausalLMNextN", "Glm4MoeLiteForCausalLMNextN"):
        try:
            conf = DeepseekV2WeightLoaderMixin._initialize_nextn_conf(SimpleNamespace(config=cfg), True)
            out["prefix"] = conf.nextn_layer_prefix + "."
        except (ValueError, AssertionError) as e:
            out["refused"] = f"{type(e).__name__}: {e}"
    if out["head_class"] == "Step3p5MTP":
        m = Step3p5MTP.__new__(Step3p5MTP)
        nn.Module.__init__(m)
        m.config, m.draft_model_idx = cfg, None
        try:
            m.load_weights([(f"model.layers.{cfg.num_hidden_layers}.enorm.weight", torch.zeros(1))])
            out["single_layer_load"] = "ok"
        except Exception as e:  # noqa: BLE001 - the exception is the answer
            out["single_layer_load"] = f"{type(e).__name__}: {e}"
    if out["head_class"] == "MiMoV2MTP":
        names = [(f"model.mtp.layers.{i}.enorm.weight", torch.zeros(1)) for i in range(3)]
        out["step1_reads"] = [n for n, _ in DefaultModelLoader._filter_mtp_weights(iter(names), "", 1)]
    return out


def main():
    jobs = json.loads(open(sys.argv[1]).read())
    json.dump({j["name"]: one(j) for j in jobs}, open(sys.argv[2], "w"))


if __name__ == "__main__":
    main()
