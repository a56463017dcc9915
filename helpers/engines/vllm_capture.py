"""The vLLM capture of what the engine feeds the draft, through the tool's worker extension
(:mod:`helpers.engines.vllm_worker`): prompts sent one at a time with the capture armed on every rank, then rank 0's
records (``drafter.propose`` inputs and target forwards, in the order written) assembled into one served sample per
prompt, the prompt's rows and each generated token's, as the server computed them
(:meth:`helpers.engines.vllm.VLLMAdapter.capture_served`).
"""
from __future__ import annotations

import contextlib
import os
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import torch
from safetensors.torch import load_file

from ..capture import prompt_fields, read_rank_capture, safe_key, sampling_params
from ..draft.sequences import dump_sequences
from ..errors import BadInput, SGLangError
from ..formats.dumps import read_dump, write_dump
from .vllm_answers import record


def _send(client: Any, prompts: Sequence[Any], cap: Path, max_new_tokens: int, layers: bool,
          records: Optional[list], sampling: Optional[dict] = None) -> list[tuple[str, Optional[list[int]], dict]]:
    """Arm the capture on every rank, send each prompt alone (prefix cache reset first), disarm. Returns
    ``(prompt id, prompt token ids or None for text, answer)`` per prompt.

    When a prompt fails or the command is interrupted (:class:`helpers.errors.Interrupted`, a signal), that error is
    the one raised: the disarm is then tried, and its own failure (after a signal every wait of the budget ends at
    once) does not replace it, so a signal still exits 130 / 143. The worker stops recording by itself after
    ``max_forwards``."""
    sent: list[tuple[str, Optional[list[int]], dict]] = []
    client.rpc("e3f_capture_start", {"out_dir": os.fspath(cap), "layers": bool(layers), "max_forwards": 100000})
    try:
        for i, p in enumerate(prompts):
            pid, ids, text = prompt_fields(p, i)
            client.reset_prefix_cache()
            temperature, extra = vllm_sampling(sampling, i)
            ans = client.complete(ids if ids is not None else text, max_tokens=max_new_tokens,
                                  temperature=temperature, extra=extra)
            sent.append((pid, ids, ans))
            if records is not None:
                records.append(record(len(records), pid, ans, kind="capture"))
    except BaseException:
        with contextlib.suppress(SGLangError):
            client.rpc("e3f_capture_stop")
        raise
    client.rpc("e3f_capture_stop")
    return sent


def vllm_sampling(sampling: Optional[Mapping[str, Any]], i: int) -> tuple[float, dict]:
    """SGLang-named sampling params (:func:`helpers.capture.sampling_params`: ``temperature``, ``top_p``, ``top_k``,
    ``sampling_seed``) as ``/v1/completions`` fields: ``(temperature, {"top_p", "top_k", "seed"})`` (vLLM's names,
    ``vllm/entrypoints/openai/completion/protocol.py::CompletionRequest``), the seed ``seed + i`` per prompt."""
    sp = sampling_params(sampling, i)
    extra = {k: sp[k] for k in ("top_p", "top_k") if sp.get(k) is not None}
    if sp.get("sampling_seed") is not None:
        extra["seed"] = int(sp["sampling_seed"])
    return float(sp["temperature"]), extra


def _answer_ids(ans: Mapping[str, Any]) -> tuple[Optional[list[int]], list[int]]:
    """(prompt token ids, generated token ids) of a ``return_token_ids`` answer."""
    ch = (ans.get("choices") or [{}])[0]
    prompt = ch.get("prompt_token_ids") or ans.get("prompt_token_ids")
    return ([int(t) for t in prompt] if prompt else None), [int(t) for t in (ch.get("token_ids") or [])]


def _segments(cap: Path) -> list[list[tuple[dict, dict[str, torch.Tensor]]]]:
    """Rank 0's records in the order written, split per request: a request starts at its prefill (the first record
    whose first position is 0 after a record that was not a prefill of the same request)."""
    try:
        recs = read_rank_capture(cap).get(0, [])
    except FileNotFoundError:
        recs = []
    segs: list[list[tuple[dict, dict[str, torch.Tensor]]]] = []
    seen_prefixes: set = set()
    for rec in recs:
        t = load_file(str(cap / "rank0" / rec["file"]))
        pos = t.get("positions")
        starts = pos is not None and pos.numel() and int(pos.reshape(-1)[0]) == 0
        prefix = rec["file"][:4]
        if starts and (not segs or prefix in seen_prefixes or not _all_prefill(segs[-1])):
            segs.append([])
            seen_prefixes = set()
        if segs:
            segs[-1].append((rec, t))
            if starts:
                seen_prefixes.add(prefix)
    return segs


def _all_prefill(seg: list) -> bool:
    return all(int(t["positions"].reshape(-1)[0]) == 0 for _, t in seg)


def _assemble(client: Any, cap: Path, sent: list, layers: bool, max_width: Optional[int]
              ) -> tuple[list[dict], list[dict]]:
    """The served samples (and the reference samples with ``layers``) from the capture folder (see
    :meth:`VLLMAdapter.capture_served`)."""
    segs = _segments(cap)
    if len(segs) != len(sent):
        raise SGLangError(f"{client._shown_url}: the capture recorded {len(segs)} request(s) for {len(sent)} prompt(s) "
                          "(is speculative decoding on, and no other client sending requests?)",
                          endpoint="/collective_rpc")
    samples, ref = [], []
    for (pid, ids, ans), seg in zip(sent, segs):
        key = safe_key(pid)
        p_ids, out_ids = _answer_ids(ans)
        prompt = ids if ids is not None else p_ids
        if prompt is None:
            raise SGLangError(f"{client._shown_url}: no prompt_token_ids in the answer for prompt {pid}",
                              endpoint="/v1/completions")
        seq = list(prompt) + list(out_ids[:-1])
        rows: dict[int, tuple[int, torch.Tensor]] = {}
        for want in ("prop", "fwd"):
            for rec, t in seg:
                if not rec["file"].startswith(want) or "aux" not in t:
                    continue
                for k, p in enumerate(t["positions"].reshape(-1).tolist()):
                    if 0 <= p < len(seq) and (want == "prop" or p not in rows or rows[p][2] == "fwd"):
                        rows[p] = (int(t["input_ids"][k]), t["aux"][k], want)
        first = min(rows) if rows else None
        if first is None or any(p not in rows for p in range(first, len(seq))):
            raise SGLangError(f"{client._shown_url}: the draft received no input for prompt {pid} at positions "
                              f"{[p for p in range(first or 0, len(seq)) if p not in rows][:5]} (is speculative "
                              "decoding on?)", endpoint="/collective_rpc")
        got = [rows[p][0] for p in range(first, len(seq))]
        if got != seq[first:]:
            bad = next(p for p in range(first, len(seq)) if rows[p][0] != seq[p])
            raise SGLangError(f"{client._shown_url}: prompt {pid}: the captured token at position {bad} is "
                              f"{rows[bad][0]}, the answer's {seq[bad]}", endpoint="/collective_rpc")
        hidden = torch.stack([rows[p][1] for p in range(first, len(seq))]).to(torch.float32)
        if max_width is not None and hidden.shape[-1] > max_width:
            raise SGLangError(f"{client._shown_url} ({pid}): hidden-state rows are {hidden.shape[-1]} wide, over the "
                              f"limit of {max_width}; nothing was written", endpoint="/collective_rpc")
        samples.append({"key": key, "sample_id": pid, "input_ids": torch.tensor(seq[first:], dtype=torch.int64),
                        "hidden": hidden, "first_position": first, "num_prompt_tokens": len(prompt),
                        "num_output_tokens": len(out_ids), "output_ids": out_ids or None})
        fwd = next((t for rec, t in seg if rec["file"].startswith("fwd") and "embedding" in t), None)
        if layers and fwd is not None:
            n = sum(1 for k in fwd if k.startswith("out("))
            need = ["embedding"] + [f"out({L})" for L in range(n)]
            ref.append({"key": key, "sample_id": pid, "input_ids": fwd["input_ids"].to(torch.int64),
                        "hidden": torch.cat([fwd[k] for k in need], -1).to(torch.float32),
                        "first_position": int(fwd["positions"].reshape(-1)[0])})
    return samples, ref


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def trace_records(cap: Path, keys: Sequence[str]) -> list[dict]:
    """The draft step trace of a capture (:meth:`helpers.engines.vllm.VLLMAdapter.trace_requests`), in the record
    format :func:`helpers.draft.trace.request_cycles` groups: rank 0's ``prop`` records that hold ``proposals``
    (:mod:`helpers.engines.vllm_worker`), one request per capture segment (``keys[i]`` is the i-th request's id).

    vLLM returns a verify cycle's draft tokens together (``SpecDecodeBaseProposer.propose``: step 1 from the sampled
    row of the first pass, steps 2 .. from ``num_speculative_tokens - 1`` decode passes fed the previous step's token),
    so each ``prop`` call gives one cycle per request: a ``DRAFT_EXTEND_V2`` row (step 1) at the sampled row's
    position ``p`` whose input is ``next_ids`` (the token of ``p + 1``: the inputs are shifted left by one), then
    ``DECODE`` rows at ``p + 1, p + 2, ...`` fed the previous proposal. Their positions and inputs are the ones vLLM's
    loop gives by construction, not read from it: on vLLM the trace compares the proposals (a wrong step-k position
    inside vLLM's decode loop shows as a diverging proposal from step 2, not as a position). ``topk_draft`` is -1 (the
    comparison maps the served target id into the draft's vocabulary)."""
    out: list[dict] = []
    for key, seg in zip(keys, _segments(cap)):
        for rec, t in seg:
            if not rec["file"].startswith("prop") or "proposals" not in t:
                continue
            props, rows, nxt = t["proposals"].to(torch.int64), t["sample_rows"].reshape(-1), t["next_ids"].reshape(-1)
            pos_all = t["positions"].reshape(-1)
            B, K = int(props.shape[0]), int(props.shape[1])
            if B == 0 or K == 0 or rows.numel() != B or nxt.numel() != B:
                continue
            p = pos_all[rows.clamp(0, pos_all.numel() - 1)]
            for s in range(K):
                inputs = nxt if s == 0 else props[:, s - 1]
                out.append({"forward": int(rec["forward"]), "mode": "DRAFT_EXTEND_V2" if s == 0 else "DECODE",
                            "rids": [key] * B, "row_req": torch.arange(B), "positions": p + s,
                            "input_ids": inputs, "topk": props[:, s:s + 1],
                            "topk_draft": torch.full((B, 1), -1, dtype=torch.int64)})
    return out


def traced_capture(adapter: Any, client: Any, prompts: Sequence[Any], *, max_new_tokens: int, folder: Path
                   ) -> tuple[list, list[dict]]:
    """The draft step trace on vLLM: one capture (``adapter.capture_served``, greedy, the prefix cache reset before
    each prompt, every rank's raw records kept under ``folder/capture``), its served states as sequences
    (:func:`helpers.draft.sequences.dump_sequences`) and its ``drafter.propose`` records as the trace
    (:func:`trace_records`).

    Raises:
        BadInput: the worker extension recorded no proposals (a server running an older extension)."""
    dump = adapter.capture_served(client, prompts, folder, name="served", max_new_tokens=max_new_tokens,
                                  capture_dir=folder / "capture")
    seqs = dump_sequences(dump)
    keys = [str(x.sample_id or x.key) for x in read_dump(dump).samples]     # the capture's request order
    records = trace_records(folder / "capture", keys)
    if not records:
        raise BadInput("the worker extension recorded no draft proposals (is this server's extension older than "
                       "this tool's? restart it with this checkout)", path=folder / "capture")
    return seqs, records


def write_layers(path: Path, ref: list, r0: dict, version: str, client: Any) -> Path:
    """The every-layer reference of a vLLM capture (the worker extension's target forwards: the embedding output and
    every layer's ``hidden + residual`` at prefill, TP rank 0) as a reference dump at ``path``
    (:func:`helpers.formats.dumps.write_dump`); ``r0`` is rank 0's capture report (``num_layers``, ``hidden_size``,
    ``tp_size``)."""
    n = r0.get("num_layers") or 0
    return write_dump(path, ref, {"kind": "reference", "engine": "vllm", "engine_version": version,
                                  "hidden_size": r0.get("hidden_size"),
                                  "source": {"type": "vllm_worker_extension", "url": client._shown_url,
                                             "captured": _now(), "tensor": "model.embed_tokens output; "
                                             "layers[L] output hidden + residual (prefill), TP rank 0"},
                                  "tp_size": r0.get("tp_size"),
                                  "layer_plan": {"tensors": ["embedding"] + [f"out({L})" for L in range(n)]}})
