"""Run an MLA EAGLE-3 draft's draft-extend forward with SGLang 0.5.23's own ``Eagle3DeepseekV2ForCausalLM``, in the
SGLang venv on CPU.

Usage (env/reference/.venv/bin/python, SGLANG_USE_CPU_ENGINE=1, PYTHONPATH with env/reference/standin):
``sglang_mla_draft_forward.py JOBS.json``, a list of ``[DRAFT_DIR, TARGET_DIR, INPUTS.pt, OUT.pt, DTYPE]`` (one
process for all: importing sglang takes seconds on 2 loaded cores; DTYPE the model's, ``float32`` or ``bfloat16``).

INPUTS.pt holds ``input_ids [T]`` (the draft-extend rows' token ids: the sequence rotated left by one), ``aux [T, W]``
(the target's aux hidden states of positions 0..T-1) and ``positions [T]``. OUT.pt gets ``logits [T, V_draft]``
float32 and ``hidden [T, H]`` (the hidden state the draft carries to its next step).

What runs is SGLang's: the model built and loaded as the draft worker does (``sglang_mla_draft_load.build_loaded``:
``ModelConfig(is_draft_model=True)``, its own ``load_weights`` with the q_a / kv_a fusion and the ``w_kc`` / ``w_vc``
split), the target's ``embed_tokens`` put in by its own ``set_embed`` (``eagle_worker_v2.py::EAGLEWorkerV2.
init_lm_head``), then one ``Eagle3DeepseekV2ForCausalLM.forward`` over a ``ForwardBatch`` in ``DRAFT_EXTEND_V2``
mode (the draft-extend pass of ``eagle_worker_v2.py::EAGLEWorkerV2._draft_extend``; its aux states in
``spec_info.hidden_states``) with SGLang's ``torch_native`` attention backend over an ``MLATokenToKVPool``: the
attention dispatch picks the weight-absorbed MLA (``forward_mla.py::forward_absorb_prepare`` / ``forward_absorb_core``)
as it does for every draft-extend batch, the logits come from its ``LogitsProcessor`` (every row in this mode), the
carried hidden state from its ``CaptureHiddenMode.FULL`` output. The batch holds one request with no prefix. An
independent check of helpers/draft/model.py, which is not imported here.
"""
import json
import os
import sys
from types import SimpleNamespace
from unittest import mock

import torch
from safetensors import safe_open

from sglang_mla_draft_load import build_loaded, init_single_process


def _target_embed(target_dir: str) -> torch.Tensor:
    for name in sorted(os.listdir(target_dir)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(target_dir, name), framework="pt") as f:
                keys = [k for k in f.keys() if k.endswith("embed_tokens.weight")]
                if keys:
                    return f.get_tensor(min(keys, key=len))
    raise SystemExit(f"{target_dir}: no embed_tokens.weight")


def forward(model, input_ids: torch.Tensor, aux: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype, attn=None):
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool, ReqToTokenPool
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch, ForwardMode
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

    attn = model.model.midlayer.self_attn if attn is None else attn      # the NextN head's: model.model.decoder
    T = int(input_ids.shape[0])
    req_pool = ReqToTokenPool(size=1, max_context_len=T + 1, device="cpu", enable_memory_saver=False)
    kv_pool = MLATokenToKVPool(size=T + 2, page_size=1, dtype=dtype, kv_lora_rank=attn.kv_lora_rank,
                               qk_rope_head_dim=attn.qk_rope_head_dim, layer_num=1, device="cpu",
                               enable_memory_saver=False)
    locs = torch.arange(1, T + 1, dtype=torch.int64)            # slot 0 is the pool's padding slot
    req_pool.req_to_token[0, :T] = locs.to(req_pool.req_to_token.dtype)
    backend = TorchNativeAttnBackend(SimpleNamespace(device="cpu", req_to_token_pool=req_pool,
                                                     token_to_kv_pool=kv_pool))
    backend.prefill_attention_backend_str = backend.decode_attention_backend_str = "torch_native"
    spec = SimpleNamespace(hidden_states=aux.to(dtype), select_index=None)
    fb = ForwardBatch(forward_mode=ForwardMode.DRAFT_EXTEND_V2, batch_size=1, input_ids=input_ids.long(),
                      req_pool_indices=torch.zeros(1, dtype=torch.int32),
                      seq_lens=torch.tensor([T], dtype=torch.int32), seq_lens_cpu=torch.tensor([T], dtype=torch.int32),
                      out_cache_loc=locs, seq_lens_sum=T, positions=positions.long())
    fb.spec_info = spec
    fb.capture_hidden_mode = CaptureHiddenMode.FULL
    fb.extend_prefix_lens = torch.zeros(1, dtype=torch.int32)
    fb.extend_prefix_lens_cpu = [0]
    fb.extend_seq_lens = torch.tensor([T], dtype=torch.int32)
    fb.extend_seq_lens_cpu = [T]
    fb.extend_start_loc = torch.zeros(1, dtype=torch.int32)
    fb.extend_num_tokens = T
    methods = []
    dispatch = attn.dispatch_attn_forward_method

    def record(batch):
        methods.append(dispatch(batch).name)
        return methods[-1] and dispatch(batch)

    with torch.no_grad(), forward_context(ForwardContext(attn_backend=backend)), \
            mock.patch.object(attn, "dispatch_attn_forward_method", record):
        backend.init_forward_metadata(fb)
        out = model.forward(input_ids.long(), positions.long(), fb)
    return out.next_token_logits.float(), out.hidden_states.float(), methods


def main(jobs_file: str) -> None:
    init_single_process()
    for draft_dir, target_dir, inputs, out, dtype in json.load(open(jobs_file)):
        model = build_loaded(draft_dir, dtype)
        # set_embed ends with torch.cuda.empty_cache() / synchronize(), which a CPU-only torch refuses: no-ops here
        with mock.patch.object(torch.cuda, "synchronize", lambda *a: None), \
                mock.patch.object(torch.cuda, "empty_cache", lambda: None):
            model.set_embed(torch.nn.Parameter(_target_embed(target_dir).to(getattr(torch, dtype)),
                                               requires_grad=False))
        x = torch.load(inputs, weights_only=True)
        logits, hidden, methods = forward(model, x["input_ids"], x["aux"], x["positions"], getattr(torch, dtype))
        torch.save({"logits": logits, "hidden": hidden, "attention": methods}, out)


if __name__ == "__main__":
    main(*sys.argv[1:])
