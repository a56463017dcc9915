"""Paged attention and KV-store ops of SGLang's ``intel_amx`` attention backend, in plain torch.

Layout (page size 1, as the intel_amx backend uses): the KV pool holds one row per token,
``k_buffer[loc] -> [Hkv, D]``; ``req_to_token[req_pool_index, pos]`` gives the pool row of a
request's token at position ``pos``.

Semantics follow the reference kernels SGLang ships for the same contract:
``sglang/srt/layers/attention/triton_ops/decode_attention.py`` and
``sglang/srt/layers/attention/triton_ops/extend_attention.py`` (prefix from the pool, extend part
from ``k_extend``/``v_extend``, causal or tree-masked), as called by
``sglang/srt/layers/attention/intel_amx_backend.py::IntelAMXAttnBackend``.

Not covered (a clear ``NotImplementedError`` is raised): sliding windows, attention sinks,
cross attention / encoder lengths, fp8 KV caches. K/V head dims may differ from Q's (MLA: the absorbed path's
MQA with D = kv_lora + rope, Dv = kv_lora, ``v_buffer`` a narrow view of ``k_buffer``; the MHA prefill of
DeepSeek models, whose extend tensors are laid out unlike the MLA pool, with no cached prefix).
"""
from __future__ import annotations

from typing import Optional

import torch


def _unsupported(what: str) -> NotImplementedError:
    return NotImplementedError(f"sgl_kernel stand-in attention: {what} is not supported "
                               "(only the Llama / EAGLE-3 path is covered)")


def _check_common(k_buffer: torch.Tensor, is_cross_attn: bool, sliding_window: int,
                  encoder_lens: Optional[torch.Tensor], sinks: Optional[torch.Tensor]) -> None:
    if is_cross_attn or encoder_lens is not None:
        raise _unsupported("cross attention")
    if sliding_window > 0:
        raise _unsupported("sliding-window attention")
    if sinks is not None:
        raise _unsupported("attention sinks")
    if k_buffer.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise _unsupported("fp8 KV cache")


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor,
            sm_scale: float, logit_cap: float) -> torch.Tensor:
    """Masked softmax attention with grouped KV heads.

    q ``[B, Q, Hq, D]``, k/v ``[B, K, Hkv, D]``, visible ``[B, Q, K]`` bool -> ``[B, Q, Hq, Dv]``
    (float32). Rows with no visible key produce zeros.
    """
    hq, hkv = q.shape[2], k.shape[2]
    if hq % hkv:
        raise ValueError(f"query heads {hq} not divisible by KV heads {hkv}")
    group = hq // hkv
    qf = q.to(torch.float32).reshape(q.shape[0], q.shape[1], hkv, group, q.shape[3])
    scores = torch.einsum("bqhgd,bkhd->bhgqk", qf, k.to(torch.float32)) * sm_scale
    if logit_cap and logit_cap > 0:
        scores = logit_cap * torch.tanh(scores / logit_cap)
    scores = scores.masked_fill(~visible[:, None, None, :, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    probs = torch.nan_to_num(probs, nan=0.0)
    out = torch.einsum("bhgqk,bkhd->bqhgd", probs, v.to(torch.float32))
    return out.reshape(q.shape[0], q.shape[1], hq, v.shape[-1])


def _gather_pool(buffer: torch.Tensor, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                 lengths: list[int]) -> torch.Tensor:
    """Pool rows of each request's first ``lengths[b]`` tokens, zero-padded: ``[B, max_len, H, D]``."""
    bsz = len(lengths)
    max_len = max(lengths) if lengths else 0
    out = buffer.new_zeros((bsz, max_len) + tuple(buffer.shape[1:]))
    for b, n in enumerate(lengths):
        if n:
            rows = req_to_token[int(req_pool_indices[b]), :n].to(torch.long)
            out[b, :n] = buffer.index_select(0, rows)
    return out


def store_cache_cpu(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    indices: torch.Tensor, row_dim: int) -> None:
    """Scatter new K/V rows into the pool: ``k_cache[indices] = k`` (rows of ``row_dim`` values).

    Args: k, v ``[T, Hkv, D]`` or ``[T, Hkv*D]``; k_cache, v_cache pool tensors; indices ``[T]`` int.
    Mirrors the naive branch of ``sglang/srt/mem_cache/memory_pool.py`` (``k_cache[indices] = k``).
    """
    idx = indices.to(torch.long)
    k_cache.view(-1, row_dim)[idx] = k.reshape(-1, row_dim).to(k_cache.dtype)
    v_cache.view(-1, row_dim)[idx] = v.reshape(-1, row_dim).to(v_cache.dtype)


def decode_attention_cpu(query: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                         k_scale: float, v_scale: float, output: torch.Tensor,
                         key: Optional[torch.Tensor], value: Optional[torch.Tensor],
                         loc: torch.Tensor, attn_logits: torch.Tensor, req_to_token: torch.Tensor,
                         req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, sm_scale: float,
                         logit_cap: float, is_cross_attn: bool = False, sliding_window: int = 0,
                         encoder_lens: Optional[torch.Tensor] = None,
                         sinks: Optional[torch.Tensor] = None) -> None:
    """One decode step: write this step's K/V at ``loc``, then attend over ``seq_lens[b]`` tokens.

    Args: query ``[B, Hq, D]``; k_buffer/v_buffer pool ``[N, Hkv, D]``; output ``[B, Hq, Dv]``
    (written); key/value ``[B, Hkv, D]`` new rows or None (already stored); loc ``[B]`` pool rows;
    attn_logits scratch (unused); req_to_token ``[R, L]`` int32; seq_lens ``[B]`` (includes the
    new token). Mirrors ``triton_ops/decode_attention.py::decode_attention_fwd`` plus the in-kernel
    KV write of the C++ op (``IntelAMXAttnBackend.forward_decode``).
    """
    _check_common(k_buffer, is_cross_attn, sliding_window, encoder_lens, sinks)
    if key is not None and value is not None:
        rows = loc.to(torch.long)
        k_buffer[rows] = key.reshape(-1, *k_buffer.shape[1:]).to(k_buffer.dtype)
        v_buffer[rows] = value.reshape(-1, *v_buffer.shape[1:]).to(v_buffer.dtype)
    lens = [int(x) for x in seq_lens.tolist()]
    bsz = len(lens)
    if bsz == 0:
        return
    k = _gather_pool(k_buffer, req_to_token, req_pool_indices, lens) * k_scale
    v = _gather_pool(v_buffer, req_to_token, req_pool_indices, lens) * v_scale
    max_len = k.shape[1]
    visible = (torch.arange(max_len)[None, :] < torch.tensor(lens)[:, None])[:, None, :]
    out = _attend(query.reshape(bsz, 1, query.shape[-2], query.shape[-1]), k, v, visible,
                  sm_scale, logit_cap)
    output.copy_(out[:, 0].to(output.dtype).reshape(output.shape))


def extend_attention_cpu(q_extend: torch.Tensor, k_extend: torch.Tensor, v_extend: torch.Tensor,
                         o_extend: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                         k_scale: float, v_scale: float, req_to_token: torch.Tensor,
                         req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                         extend_seq_lens: torch.Tensor, extend_start_loc: torch.Tensor,
                         max_len_extend: int, sm_scale: float, logit_cap: float,
                         is_cross_attn: bool = False, sliding_window: int = 0,
                         encoder_lens: Optional[torch.Tensor] = None,
                         sinks: Optional[torch.Tensor] = None,
                         tree_mask: Optional[torch.Tensor] = None, is_causal: bool = True) -> None:
    """Prefill / target-verify attention: prefix keys from the pool, extend keys from ``k_extend``.

    For request b with ``n = extend_seq_lens[b]`` new tokens and ``p = seq_lens[b] - n`` cached
    ones, query i (absolute position p+i) sees every prefix key, and extend key j when
    ``j <= i`` (causal) or, when ``tree_mask`` is given (EAGLE verify with topk > 1), when
    ``tree_mask[b, i, j]`` in the QLEN_ONLY layout ``[B * n * n]`` bool built by
    ``build_tree_kernel_efficient_cpu``.

    Args: q_extend ``[T, Hq, D]``; k_extend/v_extend ``[T, Hkv, D]``; o_extend ``[T, Hq, Dv]``
    (written); pool tensors as in :func:`decode_attention_cpu`; extend_start_loc ``[B]`` row
    offsets into the extend tensors. Mirrors ``triton_ops/extend_attention.py::extend_attention_fwd``
    (``custom_mask`` for the tree) as called by ``IntelAMXAttnBackend.forward_extend``.
    """
    _check_common(k_buffer, is_cross_attn, sliding_window, encoder_lens, sinks)
    totals = [int(x) for x in seq_lens.tolist()]
    ext = [int(x) for x in extend_seq_lens.tolist()]
    starts = [int(x) for x in extend_start_loc.tolist()]
    bsz = len(totals)
    if bsz == 0:
        return
    prefix = [t - e for t, e in zip(totals, ext)]
    if min(prefix) < 0:
        raise ValueError(f"extend attention: seq_lens {totals} shorter than extend lens {ext}")
    max_q, max_p = max(ext), max(prefix)
    hq, d = q_extend.shape[-2], q_extend.shape[-1]
    hkv = k_extend.shape[-2]
    q = q_extend.new_zeros((bsz, max_q, hq, d))
    ke = k_extend.new_zeros((bsz, max_q, hkv, k_extend.shape[-1]))
    ve = v_extend.new_zeros((bsz, max_q, hkv, v_extend.shape[-1]))
    for b in range(bsz):
        s, n = starts[b], ext[b]
        q[b, :n] = q_extend[s:s + n]
        ke[b, :n] = k_extend[s:s + n]
        ve[b, :n] = v_extend[s:s + n]
    if max_p == 0:
        # No request has a cached prefix: the pool is not read. This is also the only way SGLang calls the op when the
        # pool's layout differs from the extend tensors': the DeepSeek MHA prefill (q/k [T, H, nope + rope], v
        # [T, H, v_head]) over an MLA pool ([N, 1, kv_lora + rope]), chosen only for a prefill without a cached prefix
        # (sglang/srt/models/deepseek_common/attention_backend_handler.py::handle_attention_triton). The C++ kernel
        # attends to the prefix and the extend part in two separate passes, so it never reads the pool either.
        k, v = ke, ve
    else:
        if tuple(k_buffer.shape[1:]) != tuple(k_extend.shape[1:]) or v_buffer.shape[-1] != v_extend.shape[-1]:
            raise ValueError(f"extend attention: cached prefixes {prefix} in a pool of rows {tuple(k_buffer.shape[1:])}"
                             f" / {tuple(v_buffer.shape[1:])} cannot join extend keys {tuple(k_extend.shape[1:])} / "
                             f"values {tuple(v_extend.shape[1:])} (a pool layout other than the extend tensors' is "
                             "only valid without a cached prefix)")
        kp = _gather_pool(k_buffer, req_to_token, req_pool_indices, prefix).to(ke.dtype) * k_scale
        vp = _gather_pool(v_buffer, req_to_token, req_pool_indices, prefix).to(ve.dtype) * v_scale
        k = torch.cat((kp, ke), dim=1)
        v = torch.cat((vp, ve), dim=1)
    p_idx = torch.arange(max_p)
    e_idx = torch.arange(max_q)
    lens_p = torch.tensor(prefix)
    lens_e = torch.tensor(ext)
    vis_prefix = (p_idx[None, :] < lens_p[:, None])[:, None, :].expand(bsz, max_q, max_p)
    valid_e = (e_idx[None, :] < lens_e[:, None])
    if tree_mask is not None and tree_mask.numel() > 0:
        n0 = ext[0]
        if any(n != n0 for n in ext):
            raise ValueError("extend attention: a tree mask needs equal extend lengths")
        vis_ext = tree_mask.reshape(bsz, n0, n0).to(torch.bool)
    elif is_causal:
        vis_ext = (e_idx[None, :, None] >= e_idx[None, None, :]).expand(bsz, max_q, max_q)
    else:
        vis_ext = torch.ones(bsz, max_q, max_q, dtype=torch.bool)
    vis_ext = vis_ext & valid_e[:, None, :]
    visible = torch.cat((vis_prefix, vis_ext), dim=2)
    out = _attend(q, k, v, visible, sm_scale, logit_cap).to(o_extend.dtype)
    for b in range(bsz):
        s, n = starts[b], ext[b]
        o_extend[s:s + n] = out[b, :n].reshape(o_extend[s:s + n].shape)
