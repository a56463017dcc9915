"""EAGLE tree build/verify and KV cache-location bookkeeping, in plain torch / Python.

These are the Python-level functions SGLang's CPU path imports with ``from sgl_kernel import ...``
(not dispatcher ops). Each one follows the Triton (or Python) reference kernel that SGLang ships
for the same contract on GPUs; the source is named in each docstring. Index tensors are small
(batch x draft tokens), so the loops run over Python lists and write back once.
"""
from __future__ import annotations

import ctypes
from typing import Optional

import numpy as np
import torch


def assign_req_to_token_pool_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                 start_offset: torch.Tensor, end_offset: torch.Tensor,
                                 out_cache_loc: torch.Tensor, pool_len: int) -> None:
    """``req_to_token[rpi[i], start[i]:end[i]] = out_cache_loc[prefix[i]:prefix[i+1]]``.

    Args: req_pool_indices ``[B]``; req_to_token ``[R, pool_len]`` int32 (written);
    start/end offsets ``[B]``; out_cache_loc ``[sum(end-start)]`` int64.
    Mirrors ``sglang/srt/mem_cache/allocation.py::assign_req_to_token_pool`` (Triton).
    """
    rpi = req_pool_indices.tolist()
    starts, ends = start_offset.tolist(), end_offset.tolist()
    off = 0
    for i, r in enumerate(rpi):
        n = int(ends[i]) - int(starts[i])
        if n > 0:
            req_to_token[int(r), int(starts[i]):int(ends[i])] = \
                out_cache_loc[off:off + n].to(req_to_token.dtype)
        off += n


def assign_extend_cache_locs_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                 start_offset: torch.Tensor, end_offset: torch.Tensor,
                                 out_cache_loc: torch.Tensor, pool_len: int) -> None:
    """Gather ``req_to_token[rpi[i], start[i]:end[i]]`` for all i into ``out_cache_loc`` (int64).

    Mirrors ``sglang/kernels/ops/speculative/cache_locs.py::assign_extend_cache_locs`` (Triton).
    """
    rpi = req_pool_indices.tolist()
    starts, ends = start_offset.tolist(), end_offset.tolist()
    off = 0
    for i, r in enumerate(rpi):
        n = int(ends[i]) - int(starts[i])
        if n > 0:
            out_cache_loc[off:off + n] = req_to_token[int(r), int(starts[i]):int(ends[i])].to(
                out_cache_loc.dtype)
        off += n


def assign_draft_cache_locs_contiguous_cpu(req_pool_indices: torch.Tensor,
                                           req_to_token: torch.Tensor, seq_lens: torch.Tensor,
                                           out_cache_loc: torch.Tensor, pool_len: int, topk: int,
                                           num_steps: int) -> None:
    """Copy each request's ``topk * num_steps`` reserved slots from position ``seq_lens[i]`` on.

    ``out_cache_loc`` is ``[B * topk * num_steps]`` int64 (written).
    Mirrors ``sglang/kernels/ops/speculative/cache_locs.py::assign_draft_cache_locs_contiguous``.
    """
    n = topk * num_steps
    if out_cache_loc.numel() != len(req_pool_indices) * n:
        raise ValueError(f"out_cache_loc has {out_cache_loc.numel()} entries, expected "
                         f"{len(req_pool_indices)} x {n}")
    for i, (r, s) in enumerate(zip(req_pool_indices.tolist(), seq_lens.tolist())):
        out_cache_loc[i * n:(i + 1) * n] = req_to_token[int(r), int(s):int(s) + n].to(
            out_cache_loc.dtype)


def build_draft_decode_metadata_cpu(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                                    seq_lens: torch.Tensor, topk: int, num_steps: int,
                                    pool_len: int) -> torch.Tensor:
    """Expanded ``req_to_token`` for multi-step draft decode.

    Row ``b * topk + t`` holds request b's committed prefix (``seq_lens[b]`` slots) followed by
    candidate t's ``num_steps`` draft slots, which ``assign_draft_cache_locs_contiguous`` laid out
    at ``seq_lens[b] + t * num_steps``. Returns ``[B * topk, pool_len]`` int32 (undefined past
    ``seq_lens[b] + num_steps``). Mirrors the per-branch KV index construction of
    ``sglang/kernels/ops/speculative/cache_locs.py::generate_draft_decode_kv_indices``.
    """
    rpi, lens = req_pool_indices.tolist(), seq_lens.tolist()
    out = torch.zeros((len(rpi) * topk, pool_len), dtype=req_to_token.dtype)
    for b, (r, sl) in enumerate(zip(rpi, lens)):
        r, sl = int(r), int(sl)
        src = req_to_token[r]
        for t in range(topk):
            row = out[b * topk + t]
            row[:sl] = src[:sl]
            start = sl + t * num_steps
            row[sl:sl + num_steps] = src[start:start + num_steps]
    return out


def fill_bonus_tokens_cpu(accept_tokens: torch.Tensor, accept_lens: torch.Tensor,
                          bonus_tokens: torch.Tensor, accept_stride: int) -> None:
    """``bonus_tokens[i] = accept_tokens.flat[i * accept_stride + accept_lens[i] - 1]``.

    Mirrors ``sglang/kernels/ops/speculative/eagle.py::fill_bonus_tokens`` (Triton).
    """
    flat = accept_tokens.reshape(-1)
    idx = torch.arange(accept_lens.numel()) * accept_stride + accept_lens.to(torch.long) - 1
    bonus_tokens.copy_(flat[idx].to(bonus_tokens.dtype))


def fill_accept_out_cache_loc_cpu(accept_index: torch.Tensor, out_cache_loc: torch.Tensor,
                                  accept_out_cache_loc: torch.Tensor,
                                  size: Optional[int] = None) -> None:
    """Compact the KV slots of accepted tokens: ``out_cache_loc[accept_index[accept_index > -1]]``.

    Mirrors ``sglang/kernels/ops/speculative/eagle.py::fill_accept_out_cache_loc`` (Triton).
    """
    ai = accept_index.reshape(-1)
    if size is not None:
        ai = ai[:size]
    kept = ai[ai > -1].to(torch.long)
    accept_out_cache_loc[:kept.numel()] = out_cache_loc[kept]


def build_tree_kernel_efficient_cpu(parent_list: torch.Tensor, selected_index: torch.Tensor,
                                    verified_seq_len: torch.Tensor, tree_mask: torch.Tensor,
                                    positions: torch.Tensor, retrive_index: torch.Tensor,
                                    retrive_next_token: torch.Tensor,
                                    retrive_next_sibling: torch.Tensor, topk: int, depth: int,
                                    draft_token_num: int, tree_mask_mode: int) -> None:
    """Build the EAGLE draft tree: attention mask, positions, and first-child / next-sibling links.

    Args: parent_list ``[B, topk*(depth-1)+1]``; selected_index ``[B, n-1]`` (n =
    draft_token_num); verified_seq_len ``[B]``; tree_mask bool, ``[B*n*n]`` (QLEN_ONLY, mode 1)
    or ``[sum(seq_len)*n + B*n*n]`` (FULL_MASK, mode 0); positions ``[B*n]``; retrive_* ``[B, n]``
    pre-filled with -1. All outputs are written in place.
    Mirrors ``sglang/kernels/ops/speculative/spec_tree.py::sgl_build_tree_kernel_efficient_triton``.
    """
    if tree_mask_mode not in (0, 1):
        raise NotImplementedError(f"tree_mask_mode {tree_mask_mode} (bit-packed) is not supported")
    n = draft_token_num
    bsz = verified_seq_len.numel()
    parents = parent_list.reshape(bsz, -1).tolist()
    sel = selected_index.reshape(bsz, -1).tolist()
    lens = [int(x) for x in verified_seq_len.tolist()]
    pos = positions.tolist()
    ri = retrive_index.reshape(bsz, n).tolist()
    rnt = retrive_next_token.reshape(bsz, n).tolist()
    rns = retrive_next_sibling.reshape(bsz, n).tolist()
    mask = tree_mask.view(-1)
    prefix_sum = 0
    for b in range(bsz):
        seq_len = lens[b]
        seq_tree_idx = n * n * b + prefix_sum * n
        prefix_sum += seq_len
        pos[b * n] = seq_len

        def find(token: int) -> int:
            for pp in range(n - 1):
                if sel[b][pp] == token:
                    return pp
            return -1

        for i in range(n - 1, 0, -1):
            ri[b][i] = b * n + i
            parent_tb = sel[b][i - 1] // topk
            if parent_tb == 0:
                parent_position = 0
            else:
                pp = find(parents[b][parent_tb])
                if pp < 0:
                    continue
                parent_position = pp + 1
            nxt = rnt[b][parent_position]
            rnt[b][parent_position] = i
            if nxt != -1:
                rns[b][i] = nxt
        ri[b][0] = b * n
        for t in range(n):
            if tree_mask_mode == 0:
                row = seq_tree_idx + (seq_len + n) * t + seq_len
            else:
                row = n * n * b + n * t
            vals = [False] * n
            vals[0] = True
            if t > 0:
                cur, position = t - 1, 0
                for _ in range(depth):
                    position += 1
                    vals[cur + 1] = True
                    parent_tb = sel[b][cur] // topk
                    if parent_tb == 0:
                        break
                    cur = find(parents[b][parent_tb])
                    if cur < 0:
                        break
                pos[b * n + t] = position + seq_len
            mask[row:row + n] = torch.tensor(vals, dtype=torch.bool)
    positions.copy_(torch.tensor(pos, dtype=positions.dtype).reshape(positions.shape))
    retrive_index.copy_(torch.tensor(ri, dtype=retrive_index.dtype).reshape(retrive_index.shape))
    retrive_next_token.copy_(
        torch.tensor(rnt, dtype=retrive_next_token.dtype).reshape(retrive_next_token.shape))
    retrive_next_sibling.copy_(
        torch.tensor(rns, dtype=retrive_next_sibling.dtype).reshape(retrive_next_sibling.shape))


def verify_tree_greedy_cpu(predicts: torch.Tensor, accept_index: torch.Tensor,
                           accept_token_num: torch.Tensor, candidates: torch.Tensor,
                           retrive_index: torch.Tensor, retrive_next_token: torch.Tensor,
                           retrive_next_sibling: torch.Tensor,
                           target_predict: torch.Tensor) -> None:
    """Greedy verification: walk each request's tree, accepting the longest root path whose draft
    tokens equal the target's argmax.

    Args: predicts ``[B*n]`` int32 (written: verified token per flat draft index);
    accept_index ``[B, S]`` int32 (written: flat indices of accepted nodes, -1 padded);
    accept_token_num ``[B]`` int32 (written: accepted drafts, bonus excluded); candidates,
    retrive_* and target_predict ``[B, n]``.
    Mirrors ``sglang/kernels/ops/speculative/spec_tree.py::verify_tree_greedy_kernel_triton``.
    """
    bsz, n = candidates.shape
    steps = accept_index.shape[1]
    cand = candidates.tolist()
    ri = retrive_index.tolist()
    rnt = retrive_next_token.tolist()
    rns = retrive_next_sibling.tolist()
    tgt = target_predict.reshape(-1).tolist()
    pred = predicts.tolist()
    acc = accept_index.tolist()
    num = accept_token_num.tolist()
    for b in range(bsz):
        last = ri[b][0]
        acc[b][0] = last
        accepted = 0
        cur = 0
        for _ in range(1, steps):
            cur = rnt[b][cur]
            matched = False
            while cur != -1:
                draft_index = ri[b][cur]
                if cand[b][cur] == tgt[last]:
                    pred[last] = tgt[last]
                    accepted += 1
                    acc[b][accepted] = draft_index
                    last = draft_index
                    matched = True
                    break
                cur = rns[b][cur]
            if not matched:
                break
        num[b] = accepted
        pred[last] = tgt[last]
    predicts.copy_(torch.tensor(pred, dtype=predicts.dtype))
    accept_index.copy_(torch.tensor(acc, dtype=accept_index.dtype))
    accept_token_num.copy_(torch.tensor(num, dtype=accept_token_num.dtype))


def copy_all_layer_kv_cache_cpu(data_ptrs: torch.Tensor, strides: torch.Tensor,
                                tgt_loc: torch.Tensor, src_loc: torch.Tensor) -> None:
    """For every KV buffer (given by raw address and row stride in bytes) copy rows
    ``src_loc -> tgt_loc``; all source rows are read before any target row is written.

    Args: data_ptrs ``[L]`` int64 addresses; strides ``[L]`` int64 bytes per row;
    tgt_loc/src_loc ``[N]`` row indices.
    Mirrors ``sglang/kernels/ops/kvcache/cache_move.py::copy_all_layer_kv_cache_tiled`` (Triton).
    """
    src = src_loc.to(torch.long).numpy()
    tgt = tgt_loc.to(torch.long).numpy()
    if src.size == 0:
        return
    rows = int(max(src.max(), tgt.max())) + 1
    for ptr, stride in zip(data_ptrs.tolist(), strides.tolist()):
        buf = (ctypes.c_uint8 * (rows * int(stride))).from_address(int(ptr))
        view = np.frombuffer(buf, dtype=np.uint8).reshape(rows, int(stride))
        view[tgt] = view[src]
