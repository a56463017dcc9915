"""Run a target's NextN head with SGLang 0.5.23's own ``DeepseekV3ForCausalLMNextN``, in the SGLang venv on CPU: the
draft-extend pass of ``--speculative-algorithm NEXTN``.

Usage (env/reference/.venv/bin/python, SGLANG_USE_CPU_ENGINE=1, PYTHONPATH with env/reference/standin):
``sglang_nextn_forward.py TARGET_DIR INPUTS.pt OUT.pt [INPUTS.pt OUT.pt ...]`` (one process: importing sglang takes
seconds). INPUTS.pt holds ``input_ids [T]`` (row t: token t+1),
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


def main(target_dir: str, *pairs: str) -> None:
    init_single_process()
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.models.deepseek_nextn import DeepseekV3ForCausalLMNextN
    cfg = ModelConfig(target_dir, dtype="float32", is_draft_model=True).hf_config
    model = DeepseekV3ForCausalLMNextN(cfg)
    for p in model.parameters():
        p.data.fill_(float("nan"))
    weights = {}
    for f in sorted(glob.glob(os.path.join(target_dir, "*.safetensors"))):
        weights.update(load_file(f))
    model.load_weights(iter(weights.items()))
    # set_embed_and_head ends with torch.cuda.empty_cache() / synchronize(), which a CPU-only torch refuses
    with mock.patch.object(torch.cuda, "synchronize", lambda *a: None), \
            mock.patch.object(torch.cuda, "empty_cache", lambda: None):
        model.set_embed_and_head(torch.nn.Parameter(weights["model.embed_tokens.weight"].float(), requires_grad=False),
                                 torch.nn.Parameter(weights["lm_head.weight"].float(), requires_grad=False))
    nan = sorted(n for n, p in model.named_parameters() if torch.isnan(p).any())
    for inputs, out in zip(pairs[::2], pairs[1::2]):
        x = torch.load(inputs, weights_only=True)
        logits, hidden, methods = forward(model, x["input_ids"], x["hidden"], x["positions"], torch.float32,
                                          attn=model.model.decoder.self_attn)
        torch.save({"logits": logits, "hidden": hidden, "attention": methods, "nan_params": nan}, out)


if __name__ == "__main__":
    main(*sys.argv[1:])
