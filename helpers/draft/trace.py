"""The served draft's step trace against the checkpoint run offline on the very states the server fed.

The trace (:mod:`helpers.trace_hooks`, a forward hook on the draft's logits processor inside SGLang; on vLLM the
worker extension's ``drafter.propose`` wrapper, :func:`helpers.engines.vllm_capture.trace_records`) records, per
draft forward, the proposing rows' positions, input ids and top-k proposals (target ids). Here it is

* read and grouped per request (SGLang's ``rid``, which the probe sets itself on ``/generate``) into **verify
  cycles**: a draft-extend row (``EXTEND`` for the prompt, ``DRAFT_EXTEND_V2`` after each verify) is draft step 1,
  the ``speculative_num_steps - 1`` ``DECODE`` rows after it are steps 2 ..
  (``sglang/srt/speculative/eagle_worker_v2.py::EagleDraftWorker.draft_forward``);
* aligned with the same ``/generate`` answer's aux hidden states (``return_hidden_states``: row t = position t,
  :func:`helpers.formats.dumps.samples_from_generate`) and tokens (prompt + output), and replayed offline by the
  checkpoint (:class:`helpers.draft.model.Eagle3Draft`): step 1 from the draft-extend pass over the sequence
  (:meth:`Eagle3Draft.extend`, row ``p`` = token ``x[p+1]`` with aux row ``p``, as the worker rotates the ids), steps
  2 .. from the decode chain fed the **served** draft's own proposals (:meth:`Eagle3Draft.unroll`), so every step is
  compared on the inputs the server used;
* compared step by step: a row diverges when the served top-1 is not the checkpoint's and the checkpoint's logit gap
  between the two exceeds :data:`NEAR_TIE` (a near tie is rounding), when the served step-1 input id is not the
  sequence's token ``x[p+1]``, or when a step-k row does not sit at position ``p + k - 1``.

The first diverging step per request (the lowest draft step with a diverging row, :func:`first_divergence`) names
the mechanism (:func:`mechanism`): from step 1 on, the served
draft's weights or its inputs (``served_draft_differs``); only from step 2, the draft's own KV or positions
(``draft_kv_diverges``). Step-1 rows that diverge with the served input id are also replayed under one hypothesis,
the engine's draft-extend id shift lost (row p fed x[p] instead of x[p+1], :func:`current_token_replay`); when that
replay explains (nearly) all of them and the right ids none (:func:`current_token_hypothesis`), the probe names
``draft_extend_ids_unshifted`` instead of ``served_draft_differs``. Trees (topk > 1) are compared at step 1 only (the decode rows are beams re-ordered by
``select_top_k_tokens``; said in the result).
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

import torch
from safetensors.torch import load_file

from ..errors import BadInput
from ..formats.dumps import samples_from_generate
from ..runfiles import MAX_FILE_BYTES, loads_json, read_file_text, regular_file
from .model import Eagle3Draft, compute_threads
from .simulate import SimSequence

#: logit gap (float32 logits of the checkpoint) under which a served top-1 other than the checkpoint's is a near tie
#: (rounding between the server's kernels and this replay), not a divergence. Measured on the embedded CPU server
#: (helpers.trace_hooks on env/models/draft): the clean server's served top-1 equals the checkpoint's on every row.
NEAR_TIE = 1e-3
DRAFT_MODES = ("EXTEND", "DRAFT_EXTEND_V2")


@dataclass
class StepRow:
    """One proposing row of the served draft: ``step`` (1-based draft step in its cycle), ``position`` (the draft
    row's position p: it holds the token of p + 1 and proposes the token of p + 2), ``input_id``, ``topk`` (target
    ids, best first), ``topk_draft`` (draft-vocab ids), ``forward`` (trace file number), ``mode``."""

    step: int
    position: int
    input_id: int
    topk: list
    topk_draft: list
    forward: int
    mode: str


@dataclass
class Cycle:
    """One verify cycle of one request: its draft steps in order; ``tree`` when a decode step had several rows."""

    steps: list = field(default_factory=list)
    tree: bool = False


_RANK_DIR = re.compile(r"rank(\d+)")


def _complete_lines(path: Path, what: str) -> list[tuple[int, str]]:
    """``[(line number, text)]`` of the non-blank lines of a JSON-lines file the trace hook appends to, read by the
    one bounded reader (:func:`helpers.runfiles.read_file_text`: a FIFO, a device, a symlink loop or an oversized
    file refused naming it). A last line without its newline is left out: the hook may be writing it now."""
    text = read_file_text(path, what, expected="JSON lines")
    parts = text.split("\n")[:-1]              # the last part: "" after a final newline, else a torn line
    return [(i + 1, line) for i, line in enumerate(parts) if line.strip()]


def _line_json(path: Path, no: int, line: str, need: tuple[str, ...]) -> dict:
    try:
        rec = loads_json(line)
    except ValueError as e:                     # JSONDecodeError, JSONTooDeep
        rec, why = None, str(e).splitlines()[0][:120]
    else:
        why = None if isinstance(rec, dict) and all(k in rec for k in need) else f"expected an object with {need}"
    if why is None and not all(isinstance(rec[k], int) and not isinstance(rec[k], bool) for k in need
                               if k == "forward"):
        why = "its forward is not an integer"
    if why is not None:
        raise BadInput(f"line {no} is not a trace record ({why}): a torn or foreign line; start the server with a "
                       "new --trace-draft folder", path=path)
    return rec


def _trace_file(rank_dir: Path, idx: Path, no: int, name: Any) -> Path:
    """The trace file an index line names, confined to its rank folder (a plain file name, no link out of it)."""
    if not isinstance(name, str) or name != os.path.basename(name) or name in ("", ".", "..") or "\\" in name:
        raise BadInput(f"line {no} names the file {name!r}, not a file name inside its rank folder", path=idx)
    p = rank_dir / name
    if os.path.dirname(os.path.realpath(p)) != os.path.realpath(rank_dir):
        raise BadInput(f"line {no} names {name}, which leads out of its rank folder (a symlink)", path=idx)
    return regular_file(p, "trace file", max_bytes=MAX_FILE_BYTES)


def trace_counts(trace_dir: str | Path) -> dict[int, int]:
    """Records per rank already in a trace folder (``{rank: n}``: the complete lines of ``rank<r>/index.jsonl``), to
    read only what comes after. Only folders named ``rank<digits>`` are ranks (others are left alone).

    Raises:
        BadInput: an index that is not a regular file (a FIFO never blocks the check) or is too large."""
    out: dict[int, int] = {}
    root = Path(trace_dir)
    if not root.is_dir():
        return out
    for d in sorted(root.iterdir()):
        m = _RANK_DIR.fullmatch(d.name)
        if m is None or not d.is_dir():
            continue
        idx = d / "index.jsonl"
        out[int(m.group(1))] = len(_complete_lines(idx, "trace index")) if os.path.lexists(idx) else 0
    return out


#: the tensors of a trace record (:mod:`helpers.trace_hooks`): 1-D ``[N]`` per proposing row, 2-D ``[N, k]`` top-k
ROW_TENSORS = ("row_req", "positions", "input_ids")
TOPK_TENSORS = ("topk", "topk_draft")


def check_record(rec: dict, path: Optional[str | Path]) -> None:
    """Refuse a trace record that is not what the trace hook writes (:mod:`helpers.trace_hooks`): ``row_req``,
    ``positions``, ``input_ids`` integer ``[N]`` of one length N, ``topk`` / ``topk_draft`` integer ``[N, k]`` with
    k >= 1, every ``row_req`` >= 0 and, when the record carries its ``rids`` (a list), < ``len(rids)``.

    Raises:
        BadInput: a tensor missing, of another rank, length or dtype, or a ``row_req`` out of range (the trace file
            ``path`` and the tensor named, one line)."""
    def bad(name: str, why: str) -> BadInput:
        return BadInput(f"forward {rec.get('forward')}: {why}", path=path, field=name)

    n = None
    for name in ROW_TENSORS + TOPK_TENSORS:
        t = rec.get(name)
        if not isinstance(t, torch.Tensor):
            raise bad(name, "missing (expected an integer tensor as the trace hook writes it)")
        want = 1 if name in ROW_TENSORS else 2
        if t.dim() != want or t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
            raise bad(name, f"expected an integer tensor {'[N]' if want == 1 else '[N, k]'}, got {list(t.shape)} "
                            f"{t.dtype}")
        if n is None:
            n = int(t.shape[0])
        if int(t.shape[0]) != n:
            raise bad(name, f"{int(t.shape[0])} rows, row_req has {n} (one per proposing row)")
        if want == 2 and int(t.shape[1]) < 1:
            raise bad(name, f"shape {list(t.shape)}: no top-k column (expected [N, k >= 1])")
    req = rec["row_req"]
    rids = rec.get("rids")
    hi = len(rids) if isinstance(rids, list) else None
    if n:
        b = _bad_request_index(req.tolist(), hi)
        if b is not None:
            raise bad("row_req", _request_index_why(b, hi))


def _bad_request_index(req: list, n_rids: Optional[int]) -> Optional[int]:
    """The first request index of ``req`` outside ``0 .. n_rids - 1`` (negative, when ``n_rids`` is None), or None."""
    return next((b for b in req if b < 0 or (n_rids is not None and b >= n_rids)), None)


def _request_index_why(b: int, n_rids: Optional[int]) -> str:
    return (f"request index {b} is negative" if n_rids is None else
            f"request index {b} is outside 0 .. {n_rids - 1} (the forward's {n_rids} request ids)")


def read_trace(trace_dir: str | Path, *, rank: int = 0, since: Optional[dict[int, int]] = None) -> list[dict]:
    """The trace records of TP rank ``rank`` (every rank runs the same draft; rank 0 is read), after the first
    ``since[rank]`` (:func:`trace_counts`): ``{"forward", "mode", "rids", **tensors}`` in forward order.

    Every file is read by the bounded reader; only the index lines after ``since`` are parsed, and only the
    ``rids.jsonl`` lines back to the first of their forwards (damage left by an earlier run never fails a later
    read); a last line without its newline is skipped (the hook may be writing it).

    Raises:
        BadInput: the folder holds no trace of that rank (the server was not started with ``--trace-draft``, or the
            folder is not this machine's view of it); a FIFO / device / oversized index; a torn or foreign line
            among the lines read (file and line named); an index line naming a file outside its rank folder; a
            record whose tensors are missing or misshapen or whose ``row_req`` is out of range (:func:`check_record`,
            the trace file and tensor named)."""
    d = Path(trace_dir) / f"rank{rank}"
    idx = d / "index.jsonl"
    if not os.path.lexists(idx):
        raise BadInput(f"no draft step trace for TP rank {rank} (no {idx.name}): start the server with "
                       "`python -m helpers server start --trace-draft DIR` and read DIR on this machine", path=d)
    lines = _complete_lines(idx, "trace index")[(since or {}).get(rank, 0):]
    recs = [(no, _line_json(idx, no, line, ("forward", "file"))) for no, line in lines]
    rids: dict[int, list] = {}
    rid_file = d / "rids.jsonl"
    if recs and os.path.lexists(rid_file):
        first = min(int(r["forward"]) for _, r in recs)
        for no, line in reversed(_complete_lines(rid_file, "trace rids")):
            r = _line_json(rid_file, no, line, ("forward", "rids"))
            if r["forward"] < first:
                break
            rids[int(r["forward"])] = list(r["rids"]) if isinstance(r["rids"], list) else None
    out = []
    for no, rec in recs:
        f = _trace_file(d, idx, no, rec["file"])
        try:
            t = load_file(str(f))
        except Exception as e:                  # a damaged safetensors file: safetensors' own error types
            raise BadInput(f"cannot read the trace file ({type(e).__name__}: {str(e)[:160]})", path=f) from None
        r = {"forward": int(rec["forward"]), "mode": rec.get("mode"), "rids": rids.get(int(rec["forward"])), **t}
        check_record(r, f)
        out.append(r)
    return out


def request_cycles(records: Iterable[dict]) -> dict[str, list[Cycle]]:
    """Group trace records into per-request verify cycles (see the module docstring). A request's id is its SGLang
    ``rid`` (``ForwardBatch.rids``; ``"b<index>"`` when the trace has none). A decode row before any draft-extend row
    of its request is dropped (the request's first cycle began before the trace was armed). The records are
    :func:`read_trace`'s (checked there naming the file) or the vLLM worker's
    (:func:`helpers.engines.vllm_capture.trace_records`); each is checked again here (:func:`check_record`).

    Raises:
        BadInput: a record's tensors missing or misshapen, or a ``row_req`` outside ``0 .. len(rids) - 1`` (negative,
            where the record has no rids): the tensor named."""
    out: dict[str, list[Cycle]] = {}
    for rec in records:
        check_record(rec, None)
        mode = rec["mode"]
        rids = rec.get("rids")
        req = rec["row_req"].tolist()
        pos, ids = rec["positions"].tolist(), rec["input_ids"].tolist()
        top, topd = rec["topk"].tolist(), rec["topk_draft"].tolist()
        seen: dict[str, int] = {}
        for j, b in enumerate(req):
            rid = str(rids[b]) if rids is not None else f"b{b}"
            cycles = out.setdefault(rid, [])
            if mode in DRAFT_MODES:
                cycles.append(Cycle([StepRow(1, pos[j], ids[j], top[j], topd[j], rec["forward"], mode)]))
                continue
            if not cycles:
                continue
            c = cycles[-1]
            seen[rid] = seen.get(rid, 0) + 1
            if seen[rid] > 1:
                c.tree = True                    # topk > 1: several beams per request and step
                continue
            c.steps.append(StepRow(len(c.steps) + 1, pos[j], ids[j], top[j], topd[j], rec["forward"], mode))
    return out


def served_sequence(res: Any, prompt_ids: Optional[Sequence[int]] = None) -> SimSequence:
    """The :class:`SimSequence` of one ``/generate`` answer with ``return_hidden_states`` (tokens = prompt + output,
    aux row t = position t, ``start`` = prompt length), keyed by its ``meta_info.id`` (the rid). The prompt's ids are
    ``prompt_ids`` or the answer's ``prompt_token_ids`` (``return_prompt_token_ids``).

    Raises:
        BadInput: the answer carries no usable hidden states or no prompt ids, or its prompt block does not start at
            position 0 (a cached prefix: the probe flushes the cache first)."""
    raw = res.model_dump(exclude={"latency_s"}) if hasattr(res, "model_dump") else dict(res)
    (s,) = samples_from_generate(raw, source="trace probe /generate")
    if s.first_position:
        raise BadInput(f"the prompt block starts at position {s.first_position} (a cached prefix): flush the cache "
                       "before a traced request", field="meta_info.hidden_states")
    if prompt_ids is None:
        if s.input_ids is None:
            raise BadInput("the answer carries no prompt_token_ids (request it with return_prompt_token_ids)",
                           field="prompt_token_ids")
        prompt_ids = [int(x) for x in list(s.input_ids)[: s.num_prompt_tokens or len(s.input_ids)]]
    outs = [int(x) for x in (s.output_ids or [])]
    tokens = torch.as_tensor([int(x) for x in prompt_ids] + outs, dtype=torch.long)
    rid = str((raw.get("meta_info") or {}).get("id") or s.key)
    return SimSequence(rid, tokens, s.load(), len(prompt_ids))


def _gap(logits: torch.Tensor, served_draft_id: int) -> float:
    """The checkpoint's logit of its own best token minus that of the served one (>= 0; 0 when they agree; inf
    for a served token outside the draft's vocabulary, ``served_draft_id`` -1)."""
    if served_draft_id < 0 or served_draft_id >= logits.shape[-1]:
        return float("inf")
    return float(logits.max() - logits[served_draft_id])


@torch.no_grad()
def compare_request(draft: Eagle3Draft, seq: SimSequence, cycles: Sequence[Cycle], *, near_tie: float = NEAR_TIE
                    ) -> dict:
    """Replay one request's traced cycles offline on its served states (see the module docstring).

    Returns ``{"rid", "cycles", "compared": {step: rows}, "diverged": {step: rows}, "near_ties": n,
    "rows": [per-row dicts: cycle, step, position, served, offline, input_served, input_expected, gap, match,
    why]}``; rows past the sequence's states (the draft runs after the last verify too) are left out."""
    T = int(seq.tokens.shape[0])
    toks = seq.tokens.to(torch.long)
    ext = draft.extend(toks[1:], seq.aux[: T - 1])
    keep = [(i, c) for i, c in enumerate(cycles) if c.steps and 0 <= c.steps[0].position <= T - 2]
    rows_out: list[dict] = []
    if not keep:
        return _summary(seq.key, cycles, rows_out, 0)
    # the decode chain fed the served proposals: chains only, grouped by length so each unroll is one batch
    by_len: dict[int, list] = {}
    for i, c in keep:
        by_len.setdefault(0 if c.tree else len(c.steps), []).append((i, c))
    later: dict[tuple[int, int], torch.Tensor] = {}
    for n, group in by_len.items():
        if n < 2:
            continue
        rows = torch.tensor([c.steps[0].position for _, c in group], dtype=torch.long)
        inputs = torch.tensor([[s.topk[0] for s in c.steps[:n - 1]] for _, c in group], dtype=torch.long)
        for k, r, logits in draft.unroll(ext, rows, inputs):
            for j in range(int(r.shape[0])):
                later[(group[j][0], k + 1)] = logits[j]
    ties = 0
    for i, c in keep:
        p = c.steps[0].position
        for s in c.steps if not c.tree else c.steps[:1]:
            logits = ext.logits[p] if s.step == 1 else later.get((i, s.step))
            if logits is None:
                continue
            offline = int(draft.to_target_ids(logits.argmax()).item())
            served_d = int(s.topk_draft[0]) if s.topk_draft and int(s.topk_draft[0]) >= 0 \
                else draft.to_draft_id(int(s.topk[0]))          # a trace of target ids only (vLLM)
            gap = _gap(logits, served_d)
            expect_in = int(toks[p + 1]) if s.step == 1 else int(c.steps[s.step - 2].topk[0])
            why = None
            if s.step > 1 and s.position != p + s.step - 1:
                why = f"position {s.position}, expected {p + s.step - 1}"
            elif s.input_id != expect_in:
                why = f"input token {s.input_id}, expected {expect_in}"
            elif int(s.topk[0]) != offline:
                if gap > near_tie:
                    why = f"proposed {s.topk[0]}, the checkpoint {offline} (logit gap {gap:.4g})"
                else:
                    ties += 1
            rows_out.append({"cycle": i, "step": s.step, "position": s.position, "served": int(s.topk[0]),
                             "offline": offline, "input_served": s.input_id, "input_expected": expect_in,
                             "gap": round(gap, 6) if gap != float("inf") else None, "match": why is None, "why": why})
    out = _summary(seq.key, cycles, rows_out, ties)
    diverging = [r for r in rows_out if r["step"] == 1 and not r["match"] and r["input_served"] == r["input_expected"]]
    if diverging:
        out["current_token"] = current_token_replay(draft, toks, seq.aux, diverging, ext=ext, near_tie=near_tie)
    return out


#: share of a trace's diverging step-1 rows the current-token replay must explain to name the fault
#: (:func:`current_token_hypothesis`), and the fewest diverging rows it names it on. Measured on the committed NextN
#: head: damaged weights (right ids) had at most 1 of 29 diverging rows explained; the live fault on a share of
#: 0.12-1 of the rows 69-100 % (bench/RESULTS.md), the shortfall being rows the fault missed whose context it hit
CURRENT_TOKEN_SHARE = 0.75
CURRENT_TOKEN_MIN_ROWS = 3


@torch.no_grad()
def current_token_replay(draft: Eagle3Draft, toks: torch.Tensor, aux: torch.Tensor, rows: Sequence[dict], *,
                         ext: Optional[Any] = None, near_tie: float = NEAR_TIE) -> dict:
    """Test, on one request, the hypothesis "the engine fed the draft-extend rows the **current** token's id instead
    of the next one's" (the MTP / NextN head ``enorm(embed(x_p))`` with ``hnorm(h_p)`` where ``embed(x_{p+1})``
    belongs; an EAGLE-3 draft likewise): the checkpoint replayed offline with the ids un-rotated, and compared with
    the served proposals of the diverging step-1 rows.

    The served draft extend rotates the ids left by one (``sglang/srt/speculative/eagle_worker_v2.py::
    EagleDraftWorker._draft_extend_for_prefill``: per request ``cat(input_ids[1:], tail)``; after a verify,
    ``_draft_extend_for_decode`` feeds ``next_token_ids``, the tokens verification emitted): row ``p`` holds token
    ``x[p+1]`` with the target's state of position ``p``. Two replays of the hypothesis, each one
    :meth:`Eagle3Draft.extend` over the sequence: (a) the diverging rows alone get ``x[p]`` (the others keep
    ``x[p+1]``: a fault on some rows); (b) every row gets ``x[p]`` (``toks[:-1]``: the rotation lost everywhere, the
    context's KV included); (c) every row but the diverging ones (a row the fault missed whose context it hit: the
    context's draft KV). A row is explained when the served top-1 is the top-1 of (a), (b) or (c), or within
    ``near_tie`` of its best logit there. (A fault on a share of the rows hits context rows the trace never shows, so
    none of the three is exact for every row; on the committed NextN head a head with noise on ``eh_proj`` of 0.1-2 x
    its RMS, right ids, had 0-1 of 2-29 diverging rows explained, un-rotated ids on 10-100 % of the rows 97-100 %.) The replay with the right ids (``ext``, or recomputed) must not explain it:
    a row it explains is counted apart (``right_ids``; a diverging row normally has none, by construction).

    Args:
        draft: the checkpoint (:class:`Eagle3Draft` or a subclass, e.g. :class:`helpers.draft.nextn.NextNHead`).
        toks: int64 ``[T]`` the request's tokens (prompt + output).
        aux: ``[>= T - 1, aux width]`` the served states, row t = position t.
        rows: the diverging step-1 rows of :func:`compare_request` (``position``, ``served``: the served top-1,
            target id).
        ext: the right-id replay (:meth:`Eagle3Draft.extend` of ``toks[1:]``) when already computed.
    Returns:
        ``{"diverging": n, "explained": rows (a), (b) or (c) explains, "explained_rows": by (a), "explained_all":
        by (b), "explained_context": by (c), "right_ids": rows the right-id replay explains, "positions": [explained
        positions]}``.
    Raises:
        ValueError: a row's position outside ``[0, T - 2]``."""
    toks = toks.to(torch.long)
    T = int(toks.shape[0])
    pos = [int(r["position"]) for r in rows]
    if any(p < 0 or p > T - 2 for p in pos):
        raise ValueError(f"a diverging row's position is outside 0 .. {T - 2} (the request has {T} tokens)")
    right = ext if ext is not None else draft.extend(toks[1:], aux[: T - 1])
    ids = toks[1:].clone()
    idx = torch.tensor(pos, dtype=torch.long)
    ids[idx] = toks[idx]
    a = draft.extend(ids, aux[: T - 1])
    b = draft.extend(toks[:-1], aux[: T - 1])
    ids_c = toks[:-1].clone()
    ids_c[idx] = toks[1:][idx]
    c = draft.extend(ids_c, aux[: T - 1])

    def explains(out, r) -> bool:
        logits = out.logits[int(r["position"])]
        d = draft.to_draft_id(int(r["served"]))
        return int(draft.to_target_ids(logits.argmax()).item()) == int(r["served"]) or _gap(logits, d) <= near_tie

    ea = [explains(a, r) for r in rows]
    eb = [explains(b, r) for r in rows]
    ec = [explains(c, r) for r in rows]
    er = [explains(right, r) for r in rows]
    ok = [x or y or z for x, y, z in zip(ea, eb, ec)]
    return {"diverging": len(rows), "explained": sum(ok), "explained_rows": sum(ea), "explained_all": sum(eb),
            "explained_context": sum(ec), "right_ids": sum(er), "positions": [p for p, x in zip(pos, ok) if x]}


def current_token_hypothesis(requests: Sequence[dict], *, share: float = CURRENT_TOKEN_SHARE,
                             min_rows: int = CURRENT_TOKEN_MIN_ROWS) -> dict:
    """Whether the current-token replays (:func:`current_token_replay`, ``compare_request(...)["current_token"]``)
    of a trace's requests explain its diverging step-1 rows: ``named`` when at least ``min_rows`` rows diverge at
    step 1 with the served input id, a share >= ``share`` of them is explained and none of them is explained by the
    right-id replay. Returns ``{"named", "diverging", "explained", "explained_rows", "explained_all", "right_ids",
    "requests": requests with such rows, "share", "min_rows"}``."""
    keys = ("diverging", "explained", "explained_rows", "explained_all", "explained_context", "right_ids")
    tot = {k: sum(int((r.get("current_token") or {}).get(k, 0)) for r in requests) for k in keys}
    n = tot["diverging"]
    named = n >= min_rows and tot["explained"] >= share * n and tot["right_ids"] == 0
    return {"named": bool(named), **tot, "requests": sum(1 for r in requests if r.get("current_token")),
            "share": share, "min_rows": min_rows}


def _summary(rid: str, cycles: Sequence[Cycle], rows: list[dict], ties: int) -> dict:
    compared: dict[int, int] = {}
    diverged: dict[int, int] = {}
    for r in rows:
        compared[r["step"]] = compared.get(r["step"], 0) + 1
        if not r["match"]:
            diverged[r["step"]] = diverged.get(r["step"], 0) + 1
    return {"rid": rid, "cycles": len(cycles), "tree": any(c.tree for c in cycles), "compared": compared,
            "diverged": diverged, "near_ties": ties, "first": first_divergence(rows), "rows": rows}


def first_divergence(rows: Sequence[dict]) -> Optional[dict]:
    """The request's first diverging draft step: the row that does not match with the lowest ``step``, the earliest
    cycle among them; None when every row matches. By step first, not by time: a damaged draft need not miss at step 1
    in its very first cycle (live: the weight fault's first miss in time was a step-3 row of cycle 0, its step-1 rows
    missed from cycle 2 on), while a fault of the draft's own KV never makes step 1 miss."""
    bad = [r for r in rows if not r["match"]]
    return min(bad, key=lambda r: (r["step"], r["cycle"])) if bad else None


def mechanism(first_steps: Sequence[Optional[int]]) -> Optional[str]:
    """The finding kind the first diverging steps of the requests point to: ``served_draft_differs`` when any
    request diverges at step 1 (the served draft's weights or its inputs), ``draft_kv_diverges`` when requests
    diverge and none at step 1 (the draft's own KV or positions), None when none diverges."""
    steps = [s for s in first_steps if s is not None]
    if not steps:
        return None
    return "served_draft_differs" if min(steps) == 1 else "draft_kv_diverges"


def compare_trace(draft: Eagle3Draft, seqs: Sequence[SimSequence], records: Sequence[dict], *,
                  near_tie: float = NEAR_TIE) -> dict:
    """Every traced request of ``seqs`` (matched by rid) compared offline: ``{"requests": [compare_request ...],
    "untraced": [rids with no trace], "mechanism": kind or None, "first_steps": {rid: step}}``."""
    cycles = request_cycles(records)
    out, missing = [], []
    with compute_threads(draft):
        for seq in seqs:
            c = cycles.get(seq.key)
            if not c:
                missing.append(seq.key)
                continue
            out.append(compare_request(draft, seq, c, near_tie=near_tie))
    firsts = {r["rid"]: (r["first"] or {}).get("step") for r in out}
    return {"requests": out, "untraced": missing, "mechanism": mechanism(list(firsts.values())),
            "first_steps": firsts, "current_token": current_token_hypothesis(out)}


def brief(result: dict, rows: int = 3) -> dict:
    """A JSON-small view of :func:`compare_trace` for evidence: per request the counts and the first divergence,
    and the first ``rows`` diverging rows."""
    reqs = []
    for r in result["requests"]:
        reqs.append({k: r[k] for k in ("rid", "cycles", "tree", "compared", "diverged", "near_ties", "first")} |
                    {"diverging_rows": [x for x in r["rows"] if not x["match"]][:rows]})
    return {"requests": reqs, "untraced": result["untraced"], "mechanism": result["mechanism"],
            "first_steps": result["first_steps"], "current_token": result.get("current_token")}


def write_result(path: str | Path, result: dict) -> None:
    """The full comparison (every row) as JSON."""
    Path(path).write_text(json.dumps(result, default=lambda o: asdict(o) if hasattr(o, "__dataclass_fields__")
                                     else str(o), indent=1))


__all__ = ["CURRENT_TOKEN_MIN_ROWS", "CURRENT_TOKEN_SHARE", "NEAR_TIE", "ROW_TENSORS", "TOPK_TENSORS", "Cycle",
           "check_record", "current_token_hypothesis",
           "current_token_replay", "StepRow", "brief", "compare_request", "compare_trace", "first_divergence",
           "mechanism", "read_trace", "request_cycles", "served_sequence", "trace_counts", "write_result"]
