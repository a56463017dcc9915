"""Read MTP / NextN configs with SGLang 0.5.23's own code, in the SGLang reference venv, for
tests/unit/draft/test_mtp_checks.py to hold helpers/draft/mtp_checks.py against (an independent reading: nothing of
helpers/ is imported here).

Usage (env/reference/.venv/bin/python, SGLANG_USE_CPU_ENGINE=1): sglang_mtp_configs.py JOBS.json OUT.json; JOBS is a
list of ``{"name", "folder"}``. OUT gets ``{name: {...}}`` with ``head_class`` and ``layers``: the draft's
``architectures[0]`` and ``num_nextn_predict_layers`` after ``ModelConfig(folder, is_draft_model=True)``
(``configs/model_config.py::ModelConfig._config_draft_model``), and, for the DeepSeek / GLM families, ``prefix`` (the
checkpoint prefix SGLang's loader reads) or ``refused`` (its exception, ``type: text``) from
``models/deepseek_common/deepseek_weight_loader.py::DeepseekV2WeightLoaderMixin._initialize_nextn_conf`` called on that
config (it reads ``self.config`` only)."""
import json
import sys
from types import SimpleNamespace

from sglang.srt.configs.model_config import ModelConfig
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
    return out


def main():
    jobs = json.loads(open(sys.argv[1]).read())
    json.dump({j["name"]: one(j) for j in jobs}, open(sys.argv[2], "w"))


if __name__ == "__main__":
    main()
