"""Run a target's NextN head with SGLang 0.5.23's own ``DeepseekV3ForCausalLMNextN``, in the SGLang venv on CPU: the
draft-extend pass of ``--speculative-algorithm NEXTN``.

Usage (env/reference/.venv/bin/python, SGLANG_USE_CPU_ENGINE=1, PYTHONPATH with env/reference/standin):
``sglang_nextn_forward.py TARGET_DIR INPUTS.pt OUT.pt DTYPE [TARGET_DIR INPUTS.pt OUT.pt DTYPE ...]`` (one process: importing
sglang takes seconds; DTYPE the model's, ``float32`` or ``bfloat16``, as ``--dtype``). INPUTS.pt holds ``input_ids [T]`` (row t: token t+1),
``hidden [T, H]`` (the target's post-final-norm state at t) and ``positions [T]``; OUT.pt gets ``logits [T, V]`` and
``hidden [T, H]`` float32 and ``attention`` (the MLA forward methods SGLang's dispatch picked).

What runs is SGLang's: the model built and loaded as its NEXTN draft worker does (``sglang_mla_draft_load.
load_nextn``'s construction: ``ModelConfig(is_draft_model=True)`` renames the target's architecture to
``DeepseekV3ForCausalLMNextN``, its own ``load_weights(is_nextn=True)`` over every safetensors file of the folder),
the target's ``model.embed_tokens`` and ``lm_head`` put in by its own ``set_embed_and_head``
(``eagle_worker_v2.py::EagleDraftWorker.init_lm_head``), then one ``DeepseekV3ForCausalLMNextN.forward`` over a
``ForwardBatch`` in ``DRAFT_EXTEND_V2`` mode (the hidden states in ``spec_info.hidden_states``) through the
``torch_native`` attention backend over an ``MLATokenToKVPool`` (tests/support/sglang_mla_draft_forward.py::forward).
An independent check of helpers/draft/nextn.py, which is not imported here.
"""
import glob
import os
import sys
from unittest import mock

import torch
from safetensors.torch import load_file

from sglang_mla_draft_forward import forward
from sglang_mla_draft_load import init_single_process


def build(target_dir: str, dtype: str):
    """SGLang's NextN model of ``target_dir`` in ``dtype``, loaded and given the target's embedding and lm_head."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.models.deepseek_nextn import DeepseekV3ForCausalLMNextN
    cfg = ModelConfig(target_dir, dtype=dtype, is_draft_model=True).hf_config
    torch.set_default_dtype(getattr(torch, dtype))
    model = DeepseekV3ForCausalLMNextN(cfg)
    torch.set_default_dtype(torch.float32)
    for p in model.parameters():
        p.data.fill_(float("nan"))
    weights = {}
    for f in sorted(glob.glob(os.path.join(target_dir, "*.safetensors"))):
        weights.update(load_file(f))
    model.load_weights(iter(weights.items()))
    t = getattr(torch, dtype)
    # set_embed_and_head ends with torch.cuda.empty_cache() / synchronize(), which a CPU-only torch refuses
    with mock.patch.object(torch.cuda, "synchronize", lambda *a: None), \
            mock.patch.object(torch.cuda, "empty_cache", lambda: None):
        model.set_embed_and_head(torch.nn.Parameter(weights["model.embed_tokens.weight"].to(t), requires_grad=False),
                                 torch.nn.Parameter(weights["lm_head.weight"].to(t), requires_grad=False))
    return model


def main(*jobs: str) -> None:
    init_single_process()
    models = {}
    for target_dir, inputs, out, dtype in zip(jobs[::4], jobs[1::4], jobs[2::4], jobs[3::4]):
        if (target_dir, dtype) not in models:
            models[target_dir, dtype] = build(target_dir, dtype)
        model = models[target_dir, dtype]
        nan = sorted(n for n, p in model.named_parameters() if torch.isnan(p).any())
        x = torch.load(inputs, weights_only=True)
        logits, hidden, methods = forward(model, x["input_ids"], x["hidden"], x["positions"], getattr(torch, dtype),
                                          attn=model.model.decoder.self_attn)
        torch.save({"logits": logits, "hidden": hidden, "attention": methods, "nan_params": nan}, out)


if __name__ == "__main__":
    main(*sys.argv[1:])
