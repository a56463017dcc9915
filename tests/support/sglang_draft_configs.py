"""Read draft / target config pairs with SGLang 0.5.23's own code, in the SGLang reference venv: what the server does
with a draft config against its target's, for tests/unit/draft/test_config_checks_public.py to hold
helpers/draft/config_checks.py against (an independent reading: nothing of helpers/ is imported here).

Usage (env/reference/.venv/bin/python, SGLANG_USE_CPU_ENGINE=1): sglang_draft_configs.py JOBS.json OUT.json; JOBS is a
list of ``{"name", "draft": folder, "target": folder, "cache": bool}`` (one process for all: importing sglang takes
seconds). OUT gets ``{name: {...}}`` with, per pair:

* ``target_context``: ``ModelConfig(target).context_len`` (``sglang/srt/configs/model_config.py``);
* ``draft_derived``: ``get_context_length`` of the draft's text config (``utils/hf_transformers/common.py``);
* ``refused``: the ``ValueError`` text when ``ModelConfig(draft, is_draft_model=True, context_length=target's)`` refuses
  (what ``speculative/eagle_worker_v2.py::EagleDraftWorker.__init__`` l. 229 builds), else None;
* ``served_max_position``: the draft's ``max_position_embeddings`` once built with
  SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1;
* ``rope``: ``{"rope_theta", "rope_scaling"}`` the draft's attention passes to ``get_rope``, read from that built
  config as ``models/llama.py::LlamaDecoderLayer.__init__`` l. 322-336 reads it (transcribed: those lines are inside a
  layer constructor that needs a distributed group), or ``models/kimi_k25_eagle3.py::Eagle3MLADecoderLayer.__init__``
  l. 80-89 for ``Eagle3DeepseekV2ForCausalLM``; ``config_rope``: the same dict before llama.py's l. 329-334 edit;
* with ``cache``: ``cache_equal`` -- whether SGLang's ``get_rope`` builds the same cos/sin table from ``rope`` as from
  ``config_rope`` (head size 64).

Configs are read with ``trust_remote_code=False`` (the checkpoints' own configuration_*.py are not here; the text
fields SGLang reads are the same)."""
import copy
import json
import os
import sys

import torch

from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.layers.rotary_embedding import get_rope
from sglang.srt.utils.hf_transformers.common import get_context_length

ENV = "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN"


def rope_of(cfg, mla: bool):
    """(theta, scaling dict, scaling before llama.py's edit) as the draft's decoder layer reads them."""
    if mla:    # kimi_k25_eagle3.py l. 80-89
        if getattr(cfg, "rope_parameters", None) is not None:
            params = cfg.rope_parameters
            theta = params.get("rope_theta", 10000)
            scaling = params if params.get("rope_type") != "default" else None
        else:
            theta, scaling = cfg.rope_theta, cfg.rope_scaling
        return theta, copy.deepcopy(scaling), copy.deepcopy(scaling)
    rope_parameters = copy.deepcopy(getattr(cfg, "rope_parameters", None))        # llama.py l. 322-334
    if rope_parameters is not None:
        theta = rope_parameters.get("rope_theta", 10000)
        scaling = rope_parameters
    else:
        theta = getattr(cfg, "rope_theta", 10000)
        scaling = copy.deepcopy(getattr(cfg, "rope_scaling", None))
    before = copy.deepcopy(scaling)
    if scaling is not None and getattr(cfg, "original_max_position_embeddings", None):
        scaling["original_max_position_embeddings"] = cfg.original_max_position_embeddings
    return theta, scaling, before


def one(job):
    os.environ.pop(ENV, None)
    target = ModelConfig(job["target"], trust_remote_code=False)
    out = {"target_context": target.context_len}
    try:
        ModelConfig(job["draft"], trust_remote_code=False, is_draft_model=True, context_length=target.context_len)
        out["refused"] = None
    except ValueError as e:
        out["refused"] = str(e)
    os.environ[ENV] = "1"
    try:
        draft = ModelConfig(job["draft"], trust_remote_code=False, is_draft_model=True,
                            context_length=target.context_len)
    finally:
        os.environ.pop(ENV, None)
    free = ModelConfig(job["draft"], trust_remote_code=False)          # the draft alone: its own derived context
    out["draft_derived"] = get_context_length(free.hf_text_config)
    out["served_max_position"] = draft.hf_text_config.max_position_embeddings
    mla = (draft.hf_config.architectures or [""])[0] == "Eagle3DeepseekV2ForCausalLM"
    theta, scaling, before = rope_of(draft.hf_config, mla)
    out["rope"] = {"rope_theta": theta, "rope_scaling": scaling}
    out["config_rope"] = {"rope_theta": theta, "rope_scaling": before}
    if job.get("cache"):
        mp = draft.hf_text_config.max_position_embeddings
        a = get_rope(64, 64, mp, theta, True, scaling, dtype=torch.float32)
        b = get_rope(64, 64, mp, theta, True, copy.deepcopy(before), dtype=torch.float32)
        out["cache_equal"] = bool(a.cos_sin_cache.shape == b.cos_sin_cache.shape
                                  and torch.equal(a.cos_sin_cache, b.cos_sin_cache))
    return out


def main(jobs_file, out_file):
    jobs = json.load(open(jobs_file))
    result = {}
    for job in jobs:
        try:
            result[job["name"]] = one(job)
        except Exception as e:         # reported per pair, the test names it
            result[job["name"]] = {"error": f"{type(e).__name__}: {e}"}
    with open(out_file, "w") as f:
        json.dump(result, f, indent=1, default=str)


if __name__ == "__main__":
    main(*sys.argv[1:3])
