"""Simulated drafting: the draft run offline over a sequence, drafting and verifying as SGLang 0.5.23 does (greedy).

For a sequence ``x_0 .. x_{T-1}`` (prompt, then the target's greedy continuation from position ``start``) and the
aux hidden states the target computed for it (row t = position t), every verify step is replayed:

* draft-extend (``speculative/eagle_worker_v2.py::EAGLEWorkerV2._draft_extend``): the ids rotated left by one, so
  draft row t takes token ``x_{t+1}`` with aux row t; the KV cache of committed positions always comes from these rows
  (accepted tokens are re-extended with the target's aux states after each verify step);
* a verify step whose last committed token is ``x_c`` drafts from row ``c-1``: level 0 is the top-``topk`` of that
  row's draft logits; ``speculative_num_steps - 1`` further draft forwards follow (``EAGLEWorkerV2.draft_forward``),
  each node at position ``c + i`` with its parent's hidden state, attending to rows ``0..c-1`` and its own ancestors;
* topk 1: a chain (argmax per level, ``num_draft_tokens = steps + 1``); topk > 1: the k x k expansions scored by
  cumulative probability, the top k kept as the next level's beams (``speculative/spec_utils.py::
  _select_top_k_tokens_later``), and the tree the top ``num_draft_tokens - 1`` of all candidates
  (``speculative/eagle_utils.py::organize_draft_results``);
* greedy verification (``eagle_utils.py::verify_tree_greedy_func``): walk from the root along the target's tokens;
  the accepted drafts are the depth reached, plus the bonus token.

Counters follow SGLang's (``managers/tokenizer_manager.py::TokenizerManager._calculate_spec_decoding_metrics``):
``completion_tokens`` includes the token the prefill produced, ``verify_ct`` counts verify steps, accept length =
completion_tokens / verify_ct (bonus token included), accept rate = correct drafts / (verify_ct x (draft tokens - 1)).

Also computed, as the training frameworks log it: the *marginal* teacher-forced accuracy of draft step k (the draft
fed the target's tokens and its own hidden chain, right or wrong before), over all rows of the continuation.
"""
from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

import numpy as np
import pandas as pd
import torch

from ..acceptance.measure import summarize
from ..acceptance.requests import PER_REQUEST_COLUMNS
from ..errors import BadInput
from .model import Eagle3Draft, compute_threads


@dataclass(frozen=True)
class DraftSettings:
    """``--speculative-num-steps`` (S), ``--speculative-eagle-topk`` (k), ``--speculative-num-draft-tokens`` (N).

    Raises (``check``): BadInput when SGLang would not accept them: S >= 1, k >= 1, N >= 2, a chain (k = 1) has
    N = S + 1 (``server_args`` sets it so for topk 1), a tree has N - 1 <= k + (S - 1) k^2 candidates.
    """

    steps: int
    topk: int
    draft_tokens: int

    def check(self) -> "DraftSettings":
        s, k, n = self.steps, self.topk, self.draft_tokens
        if s < 1 or k < 1 or n < 2:
            raise BadInput(f"steps {s}, topk {k}, draft tokens {n}: expected steps >= 1, topk >= 1, draft tokens >= 2",
                           field="--steps/--topk/--draft-tokens")
        if k == 1 and n != s + 1:
            raise BadInput(f"topk 1 drafts a chain of {s} tokens, so draft tokens must be {s + 1} (got {n})",
                           field="--draft-tokens")
        if k > 1 and n < s + 1:
            raise BadInput(f"a topk-{k} tree of {s} steps needs at least {s + 1} draft tokens (got {n}): SGLang 0.5.23 "
                           "moves the accepted path (steps + 1 tokens) to the front of the draft tokens' slots "
                           "(sglang/srt/speculative/eagle_worker_common.py::_compact_accept_to_front) and fails at the "
                           "first verify step", field="--draft-tokens")
        if n - 1 > k + (s - 1) * k * k:
            c = k + (s - 1) * k * k
            raise BadInput(f"{n} draft tokens (the verified root and {n - 1} drafted), but {s} steps of topk {k} give "
                           f"only {c} candidates: expected draft tokens <= {c + 1}", field="--draft-tokens")
        return self

    @property
    def label(self) -> str:
        return f"steps {self.steps}, topk {self.topk}, draft tokens {self.draft_tokens}"

    @classmethod
    def chain(cls, steps: int) -> "DraftSettings":
        return cls(steps, 1, steps + 1)



@dataclass
class SimSequence:
    """One sequence to simulate.

    Attributes:
        key: id (prompt id or training sample id), used to pair with live measurements.
        tokens: int64 ``[T]`` target ids, prompt then continuation.
        aux: ``[R, W]`` aux hidden states, row t = position t (R >= T - 1; rows past T - 2 are unused).
        start: index of the first generated token (the prefill's output); rounds are simulated from there.
        targets: int64 ``[T]``, the target's own greedy token at each position (``targets[j]`` = the target's argmax
            after ``x_0..x_{j-1}``); None when ``tokens`` is itself the target's greedy continuation.
    """

    key: str
    tokens: torch.Tensor
    aux: torch.Tensor
    start: int
    targets: Optional[torch.Tensor] = None


def _teacher_forced(draft: Eagle3Draft, ext, seq: SimSequence, steps: int, y: torch.Tensor) -> np.ndarray:
    """``match [steps, T-1]``: 1 where draft step k from row t predicts ``y[t+2+k]`` (teacher-forced chain: step k
    takes ``y[t+1+k]`` and the hidden state of step k-1 at the same row), 0 where not, -1 beyond the sequence."""
    T = int(seq.tokens.shape[0])
    r0 = max(seq.start - 1, 0)
    rows = torch.arange(T - 1)
    match = np.full((steps, T - 1), -1, dtype=np.int8)
    pred = draft.to_target_ids(ext.logits.argmax(-1)).cpu()
    ok = rows + 2 <= T - 1
    match[0, ok.numpy()] = (pred[ok] == y[rows[ok] + 2]).numpy().astype(np.int8)
    for k, r, logits in draft.ttt_steps(ext, y, steps, r0):
        pred = draft.to_target_ids(logits.argmax(-1)).cpu()
        ok = r + 2 + k <= T - 1
        match[k, r[ok].numpy()] = (pred[ok] == y[r[ok] + 2 + k]).numpy().astype(np.int8)
    return match


def _chain_accepts(match: np.ndarray, steps: int) -> np.ndarray:
    """Accepted drafts per row for a chain of ``steps``: the leading run of matches (-1 ends it)."""
    acc = np.zeros(match.shape[1], dtype=np.int64)
    alive = np.ones(match.shape[1], dtype=bool)
    for k in range(min(steps, match.shape[0])):
        alive &= match[k] == 1
        acc += alive
    return acc


def _tree_accepts(draft: Eagle3Draft, ext, seq: SimSequence, st: DraftSettings, y: torch.Tensor,
                  rows: torch.Tensor) -> np.ndarray:
    """Accepted drafts per row in ``rows`` for a topk > 1 tree (see the module docstring)."""
    k, S, N = st.topk, st.steps, st.draft_tokens
    T = int(seq.tokens.shape[0])
    R = rows.shape[0]
    probs = torch.softmax(ext.logits[rows], dim=-1)
    p0, i0 = probs.topk(k, dim=-1)                                        # [R, k]
    scores_all = [p0]                                                     # level 0: k candidates
    tokens_all = [draft.to_target_ids(i0).cpu()]
    parents_all = [torch.full((R, k), -1, dtype=torch.long)]
    beam_tok, beam_score = tokens_all[0], p0
    beam_flat = torch.arange(k).expand(R, k)
    beam_hidden = ext.hidden[rows].repeat_interleave(k, dim=0)            # [R*k, H]
    beam_path: list = []
    rr = rows.repeat_interleave(k)
    for i in range(S - 1):
        hidden, logits, kv = draft.step(beam_tok.reshape(-1), beam_hidden, rr + 1 + i, rr + 1, ext, beam_path)
        pr = torch.softmax(logits, dim=-1)
        pk, ik = pr.topk(k, dim=-1)                                       # [R*k, k]
        expand = beam_score[:, :, None] * pk.view(R, k, k)                # [R, k, k]
        tok = draft.to_target_ids(ik).cpu().view(R, k * k)
        scores_all.append(expand.reshape(R, k * k))
        tokens_all.append(tok)
        parents_all.append(beam_flat.repeat_interleave(k, dim=1))
        cs_p, cs_i = expand.reshape(R, k * k).topk(k, dim=-1)            # next beams
        base = k + i * k * k
        parent_beam = cs_i // k                                           # [R, k]
        sel = (torch.arange(R)[:, None] * k + parent_beam).reshape(-1)
        beam_tok = torch.gather(tok, 1, cs_i)
        beam_score = cs_p
        beam_flat = base + cs_i
        beam_hidden = hidden[sel]
        beam_path = [[(kk[sel], vv[sel]) for kk, vv in p] for p in beam_path] + [[(kk[sel], vv[sel]) for kk, vv in kv]]
    scores = torch.cat(scores_all, dim=1)
    tokens = torch.cat(tokens_all, dim=1)
    parents = torch.cat(parents_all, dim=1)
    keep = scores.topk(N - 1, dim=-1).indices                             # [R, N-1]
    acc = np.zeros(R, dtype=np.int64)
    kept = [set(r) for r in keep.tolist()]
    tok_l, par_l = tokens.tolist(), parents.tolist()
    for b in range(R):
        c = int(rows[b]) + 1
        cur, depth = -1, 0
        while c + 1 + depth <= T - 1:
            want = int(y[c + 1 + depth])
            nxt = next((j for j in kept[b] if par_l[b][j] == cur and tok_l[b][j] == want), None)
            if nxt is None:
                break
            cur, depth = nxt, depth + 1
        acc[b] = depth
    return acc


def _walk(acc_by_row: np.ndarray, start: int, T: int, steps: int, max_new_tokens: Optional[int]) -> dict:
    """Replay the verify steps of one request from per-row accepted counts (row = last committed index - 1)."""
    limit = T - 1 if max_new_tokens is None else min(T - 1, start + max_new_tokens - 1)
    c, verify, correct = start, 0, 0
    hist = np.zeros(steps + 1, dtype=np.int64)
    while c < limit:
        n = int(acc_by_row[c - 1])
        verify += 1
        hist[n] += 1
        correct += n
        c += n + 1
    completion = min(c, limit) - start + 1
    return {"verify_ct": verify, "completion_tokens": completion, "correct_drafts": correct, "hist": hist}


@torch.no_grad()
def simulate_sequences(draft: Eagle3Draft, seqs: Iterable[SimSequence], settings: Sequence[DraftSettings], *,
                       max_new_tokens: Optional[int] = None, progress=None) -> dict:
    """Simulate every sequence under every setting.

    Args:
        draft: the loaded draft (:meth:`helpers.draft.model.Eagle3Draft.load`).
        seqs: the sequences (aux states from training data, a served capture, or a corrected reference).
        settings: the draft settings to replay (each :meth:`DraftSettings.check`-ed).
        max_new_tokens: cut each request after this many generated tokens (as the live requests were), else the
            whole continuation.
        progress: optional callable taking one line per sequence.

    Returns:
        ``{"per_request": {settings: DataFrame with the live measurement's per-request columns},
        "marginal": [acc_step_0, ...] (teacher-forced, over all continuation rows), "marginal_rows": rows per step,
        "marginal_hits" / "marginal_rows_per_seq": the same per sequence (lists of per-step counts),
        "greedy_share": fraction of continuation positions whose token is the target's own choice}``.

    Raises:
        BadInput: a sequence too short to verify anything, aux rows fewer than T - 1, or settings SGLang refuses.
    """
    with compute_threads(draft):
        return _simulate(draft, seqs, [s.check() for s in settings], max_new_tokens, progress)


def _simulate(draft: Eagle3Draft, seqs: Iterable[SimSequence], settings: list[DraftSettings],
              max_new_tokens: Optional[int], progress) -> dict:
    smax = max(s.steps for s in settings)
    rows: dict[DraftSettings, list[dict]] = {s: [] for s in settings}
    m_hits = np.zeros(smax)
    m_rows = np.zeros(smax)
    greedy_num = greedy_den = 0
    seq_hits: list[list[int]] = []
    seq_rows: list[list[int]] = []
    for n_seq, seq in enumerate(seqs):
        T = int(seq.tokens.shape[0])
        if seq.start < 1 or seq.start > T - 2:
            raise BadInput(f"sequence {seq.key}: the continuation starts at {seq.start} of {T} tokens; at least one "
                           "prompt token and two generated tokens are needed", field="start")
        if seq.aux.shape[0] < T - 1:
            raise BadInput(f"sequence {seq.key}: {seq.aux.shape[0]} aux rows for {T} tokens (expected >= {T - 1})",
                           field="aux")
        toks = seq.tokens.to(torch.long).cpu()
        y = toks if seq.targets is None else seq.targets.to(torch.long).cpu()
        greedy_num += int((y[seq.start:] == toks[seq.start:]).sum())
        greedy_den += T - seq.start
        ext = draft.extend(toks[1:], seq.aux[: T - 1])
        match = _teacher_forced(draft, ext, seq, smax, y)
        cont = np.arange(T - 1) >= seq.start - 1
        hits = [int((match[k][cont] == 1).sum()) for k in range(smax)]
        nrows = [int((match[k][cont] >= 0).sum()) for k in range(smax)]
        m_hits += hits
        m_rows += nrows
        seq_hits.append(hits)
        seq_rows.append(nrows)
        for st in settings:
            if st.topk == 1:
                acc = _chain_accepts(match, st.steps)
            else:
                r = torch.arange(seq.start - 1, T - 1)
                acc = np.zeros(T - 1, dtype=np.int64)
                acc[seq.start - 1:] = _tree_accepts(draft, ext, seq, st, y, r)
            w = _walk(acc, seq.start, T, st.steps, max_new_tokens)
            row = {c: None for c in PER_REQUEST_COLUMNS}
            hist = [int(h) for h in w["hist"]]
            row.update(idx=n_seq, prompt_id=seq.key, kind="simulated", has_spec=w["verify_ct"] > 0, error=None,
                       prompt_tokens=seq.start, completion_tokens=w["completion_tokens"], cached_tokens=0,
                       verify_ct=w["verify_ct"], correct_drafts=w["correct_drafts"],
                       proposed_drafts=w["verify_ct"] * (st.draft_tokens - 1), hist_correct_drafts=w["correct_drafts"],
                       histogram=json.dumps(hist),
                       accept_length=w["completion_tokens"] / w["verify_ct"] if w["verify_ct"] else None,
                       accept_rate=(w["correct_drafts"] / (w["verify_ct"] * (st.draft_tokens - 1))
                                    if w["verify_ct"] else None),
                       latency_s=float("nan"), e2e_latency_s=float("nan"))
            rows[st].append(row)
        if progress is not None:
            progress(f"simulated {seq.key} ({T} tokens)")
    marginal = [float(m_hits[k] / m_rows[k]) if m_rows[k] else float("nan") for k in range(smax)]
    return {"per_request": {s: pd.DataFrame(r, columns=PER_REQUEST_COLUMNS) for s, r in rows.items()},
            "marginal": marginal, "marginal_rows": [int(x) for x in m_rows],
            "marginal_hits": seq_hits, "marginal_rows_per_seq": seq_rows,
            "greedy_share": (greedy_num / greedy_den) if greedy_den else float("nan")}


def summary(per_request: pd.DataFrame, steps: int, *, seed: int = 0) -> dict:
    """Accept length / rate with bootstrap CIs over sequences and P(accepted >= j) per position, from a simulated
    per-request frame (the same statistics as a live measurement: :func:`helpers.acceptance.measure.summarize`)."""
    with warnings.catch_warnings():                   # no latencies in a simulation: their quantiles are all-NaN
        warnings.simplefilter("ignore", RuntimeWarning)
        s, pos, hist, _ = summarize(per_request, positions=steps, seed=seed)
    keep = ("accept_length", "accept_length_lo", "accept_length_hi", "accept_rate", "accept_rate_lo",
            "accept_rate_hi", "verify_steps", "completion_tokens", "correct_drafts", "proposed_drafts", "n_spec")
    out = {k: s.get(k) for k in keep}
    out["p_accept_ge"] = [float(x) for x in pos["marginal"]] if len(pos) else []
    out["histogram"] = [int(x) for x in hist]
    return out
