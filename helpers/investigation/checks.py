"""Hypotheses as measurements: each named check returns a verdict, a plain-words explanation, an
evidence table and a figure, computed from dumps and measurements of a live server instead of from
reading engine code.

The checks mirror the questions of a public report of a hunt (Kimi-K2.5, TP 8, EAGLE-3) where the
config fed the embedding to the draft: "does VocabParallelEmbedding all-reduce?", "concat order and
TP width", "are the captured states full 7168 or 896-wide shards?", the final discovery that the
embedding had been put in place of a layer, the num-steps override, and the later finding that
verify time bounds tok/s once acceptance is fixed.

Every check takes an :class:`helpers.investigation.inputs.Investigation` (the server under test plus its training
data and configs; it captures what a check needs, once, and keeps it) and keyword parameters. A check's
verdict is about its *hypothesis of a fault*: ``confirmed`` (the fault is there), ``refuted``
(measured and absent), ``inconclusive`` (the data cannot decide; the explanation says what is
missing).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import pandas as pd
import torch

from ..diagnosis.detectors import detect_vocab_map_missing
from ..draft.budget import acceptance_budget
from ..draft.offline import offline_inputs
from ..draft.precision import choose_dtype, server_dtype
from ..draft.simulate import DraftSettings
from ..diagnosis.static import static_check
from ..formats.configs import read_draft_config, read_draft_weights
from ..layers.ids import layer_index
from ..plots.checks import bar_figure, chunk_layer_figure
from ..records import HypothesisEntry, HypothesisStep
from ..runfiles import jsonable
from .catalog import CHECK_SPECS
from .inputs import Investigation

VERDICTS = ("confirmed", "refuted", "inconclusive")


@dataclass
class HypothesisResult:
    """Outcome of one check.

    ``evidence``: a table (pandas) of the measured numbers; ``figure``: a plotly figure or None;
    ``data``: the key numbers as JSON-safe values (for the postmortem and tests).
    """

    check: str
    title: str
    question: str
    verdict: str
    explanation: str
    evidence: pd.DataFrame = field(default_factory=pd.DataFrame)
    figure: Any = None
    data: dict = field(default_factory=dict)
    label: str = ""

    def __post_init__(self) -> None:
        if self.verdict not in VERDICTS:
            raise ValueError(f"verdict must be one of {VERDICTS}, got {self.verdict!r}")

    def entry(self, check: str, figure: Optional[str]) -> HypothesisEntry:
        """The recorded form (:class:`helpers.records.HypothesisEntry`) of this result of check ``check``, its
        figure written to ``figure`` (relative to the run folder) or None."""
        return HypothesisEntry(check=check, title=self.title, question=self.question, verdict=self.verdict,
                               explanation=self.explanation, short=(self.data or {}).get("short", ""),
                               evidence=self._evidence_records(), figure=figure)

    def step(self, *, index: int, check: str, label: str, on_fix: str, expect: Optional[str],
             figure: Optional[str]) -> HypothesisStep:
        """The replay step (:class:`helpers.records.HypothesisStep`) of this result: check ``check`` run as step
        ``index`` on fix ``on_fix``, compared with the case's ``expect``."""
        return HypothesisStep(index=index, check=check, label=label, question=self.question, on_fix=on_fix,
                              verdict=self.verdict, expect=expect,
                              as_expected=None if expect is None else expect == self.verdict,
                              explanation=self.explanation, evidence=self._evidence_records(),
                              data=jsonable(self.data), figure=figure)

    def _evidence_records(self) -> list:
        return json.loads(self.evidence.to_json(orient="records")) if len(self.evidence) else []

    def to_dict(self) -> dict:
        """JSON-safe form (evidence as records, figure as plotly JSON)."""
        return {"check": self.check, "title": self.title, "question": self.question,
                "label": self.label, "verdict": self.verdict, "explanation": self.explanation,
                "evidence": self._evidence_records(),
                "figure": None if self.figure is None else json.loads(self.figure.to_json()),
                "data": jsonable(self.data)}



# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------
def rel_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """DeepGEMM relative difference ``1 - 2<x,y> / (|x|^2 + |y|^2)`` (0 = identical)."""
    x, y = x.double().flatten(), y.double().flatten()
    den = float((x * x).sum() + (y * y).sum())
    return 0.0 if den == 0 else float(1 - 2 * (x * y).sum() / den)


def _paired(a: list[dict], b: list[dict]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Rows of samples with identical token ids, paired (same prompt captured twice)."""
    index = {tuple(s["input_ids"]): s["hidden"] for s in b}
    return [(s["hidden"], index[tuple(s["input_ids"])]) for s in a if tuple(s["input_ids"]) in index]


def _chunk_frame(inv: Investigation) -> pd.DataFrame:
    d = inv.diagnosis()
    trained = list(d.training_plan.tensors) if d.training_plan is not None else []
    configured = list(d.served_plan.tensors) if d.served_plan is not None else []
    rows = []
    for ch in d.chunks:
        i = ch["index"]
        rows.append({"chunk": i, "width": ch["width"],
                     "configured": configured[i] if i < len(configured) else None,
                     "measured (reference)": ch["identified_as"],
                     "trained": trained[i] if i < len(trained) else None,
                     "matched training chunk": ch["matched_training_chunk"],
                     "rel_diff vs training": ch["rel_diff"], "cosine vs training": ch["cosine"]})
    frame = pd.DataFrame(rows)
    for col in ("configured", "measured (reference)", "trained"):  # keep None (not NaN) for
        if col in frame:                                           # unidentified / missing chunks
            frame[col] = pd.Series([r[col] for r in rows], dtype=object)
    return frame


# --------------------------------------------------------------------------------------------
# Checks
# --------------------------------------------------------------------------------------------
def check_tp_sharding(inv: Investigation, **_: Any) -> HypothesisResult:
    """Are the aux hidden states TP-sharded (H/tp wide) or per-rank different, instead of full and identical on every
    rank (captured between layers by ``sglang/srt/models/llama.py::LlamaModel.forward``)?"""
    H = inv.hidden_size
    info = inv.server_info()
    tp = int(info.get("tp_size") or 1)
    served = inv.tensors(inv.served_dump())
    width = int(served[0]["hidden"].shape[1])
    n_full = width / H
    rows = [{"measure": "served row width", "value": width},
            {"measure": "hidden size H", "value": H},
            {"measure": "TP size", "value": tp},
            {"measure": "chunks if full width (W / H)", "value": n_full},
            {"measure": "chunks if sharded (W / (H/tp))", "value": width / (H / tp)}]
    data = {"width": width, "hidden_size": H, "tp_size": tp}
    sharded = tp > 1 and width % H != 0 and width % (H // tp) == 0
    rank_diffs: list[float] = []
    sum_rel = None
    if inv.capture_dir is not None and tp > 1:
        per = [inv.tensors(p) for p in inv.rank_dumps("aux")]
        base = per[0]
        for r, other in enumerate(per[1:], start=1):
            pairs = _paired(base, other)
            d = max(float((a - b).abs().max()) for a, b in pairs) if pairs else float("nan")
            rank_diffs.append(d)
            rows.append({"measure": f"max |aux(rank 0) - aux(rank {r})|", "value": d})
        pairs0 = _paired(served, base)
        if pairs0:
            sum_rel = rel_diff(torch.cat([a for a, _ in pairs0]), torch.cat([b for _, b in pairs0]))
            rows.append({"measure": "rel_diff(served, rank 0 aux)", "value": sum_rel})
    data["rank_max_abs_diff"] = rank_diffs
    agree = all(d <= 1e-5 * max(1.0, float(served[0]["hidden"].abs().max())) for d in rank_diffs)
    if sharded:
        data["short"] = f"the aux states are TP-sharded ({width} wide instead of a multiple of {H})"
        verdict = "confirmed"
        text = (f"The served rows are {width} wide: a multiple of H/tp = {H // tp} but not of H = {H}. "
                "Each rank contributes a shard of the hidden dimension instead of the full residual "
                "stream, so the draft's fc reads the wrong features.")
    elif rank_diffs and not agree:
        data["short"] = "the aux states differ across TP ranks (per-rank partial values)"
        verdict = "confirmed"
        tol = 1e-5 * max(1.0, float(served[0]["hidden"].abs().max()))
        differ = [r + 1 for r, d in enumerate(rank_diffs) if d > tol]
        data["ranks_differing"] = differ
        which = (f"rank {differ[0]} differs from rank 0, the other ranks agree" if len(differ) == 1 else
                 f"ranks {', '.join(map(str, differ))} differ from rank 0")
        data["short"] = f"the aux states differ across TP ranks ({which})"
        text = (f"The rows are full width ({width} = {n_full:g} x H) but the TP ranks disagree: {which} "
                f"(max |difference| {max(rank_diffs):.3g}): the aux states are per-rank partial values, "
                "not the all-reduced residual stream every rank should hold.")
    elif tp == 1:
        verdict = "refuted"
        text = (f"The server runs at TP 1, so nothing is sharded; the rows are {width} = {n_full:g} x H "
                "wide as the draft expects.")
    else:
        verdict = "refuted"
        extra = ("and all TP ranks hold identical values (per-rank capture), " if rank_diffs else
                 "(no per-rank capture was available to compare ranks) ")
        text = (f"The served rows are full width: {width} = {n_full:g} x H ({H}), not multiples of the "
                f"{H // tp}-wide shards of TP {tp}, {extra}so the residual stream is all-reduced "
                "before capture, as in standard tensor parallelism (row-parallel o_proj/down_proj "
                "outputs are summed before the residual add).")
    fig = bar_figure([f"rank 0 vs {r}" for r in range(1, len(rank_diffs) + 1)] or ["width"],
               rank_diffs or [width], "Per-rank aux hidden states: max |difference|" if rank_diffs
               else "Served row width", "max |diff|" if rank_diffs else "values")
    return HypothesisResult("tp_sharding", "TP sharding of the captured states", "", verdict, text,
                            pd.DataFrame(rows), fig, data)


def check_embedding_all_reduce(inv: Investigation, **_: Any) -> HypothesisResult:
    """Is the embedding the draft may receive a per-rank partial rather than the full embedding (not all-reduced as in
    ``sglang/srt/layers/vocab_parallel_embedding.py::VocabParallelEmbedding.forward``)?"""
    H = inv.hidden_size
    tp = int(inv.server_info().get("tp_size") or 1)
    vocab = int(inv.target_config["vocab_size"])
    served = inv.tensors(inv.served_dump())
    rows: list[dict] = []
    data: dict[str, Any] = {"tp_size": tp}
    if inv.capture_dir is None:
        return HypothesisResult("embedding_all_reduce", "Embedding all-reduce", "", "inconclusive",
                                "No per-rank capture of the embedding: start the server with the "
                                "helpers.hooks capture specs to measure what each rank holds.",
                                pd.DataFrame(), None, data)
    full = [inv.tensors(p) for p in inv.rank_dumps("embedding")]
    local = [inv.tensors(p) for p in inv.rank_dumps("embedding_local")]
    per_rank_zero = []
    sum_rel = None
    for r in range(len(full)):
        zs = torch.cat([s["hidden"].abs().sum(1) == 0 for s in local[r]])
        ids = torch.tensor([t for s in local[r] for t in s["input_ids"]])
        shard = _vocab_shard_mask(ids, vocab, r, len(full))
        outside_zero = bool(zs[~shard].all()) if (~shard).any() else True
        inside_nonzero = bool((~zs[shard]).all()) if shard.any() else True
        same = rel_diff(torch.cat([s["hidden"] for s in full[r]]), torch.cat([s["hidden"] for s in full[0]]))
        per_rank_zero.append(float(zs.float().mean()))
        rows.append({"rank": r, "tokens": int(ids.numel()),
                     "rank-local rows that are zero": int(zs.sum()),
                     "zero exactly outside its vocab shard": outside_zero and inside_nonzero,
                     "rel_diff(all-reduced embedding, rank 0's)": same})
    if len(local) > 1:
        tot = torch.cat([sum(s["hidden"] for s in col) for col in zip(*local)]) if all(
            len(l) == len(local[0]) for l in local) else None
        if tot is not None:
            sum_rel = rel_diff(tot, torch.cat([s["hidden"] for s in full[0]]))
    data["sum_of_local_vs_full_rel_diff"] = sum_rel
    # which embedding, if any, is among the served chunks?
    match_full, match_local = [], []
    for c in range(served[0]["hidden"].shape[1] // H):
        sl = slice(c * H, (c + 1) * H)
        pf = _paired([{"input_ids": s["input_ids"], "hidden": s["hidden"][:, sl]} for s in served], full[0])
        pl = _paired([{"input_ids": s["input_ids"], "hidden": s["hidden"][:, sl]} for s in served], local[0])
        match_full.append(rel_diff(torch.cat([a for a, _ in pf]), torch.cat([b for _, b in pf])) if pf else None)
        match_local.append(rel_diff(torch.cat([a for a, _ in pl]), torch.cat([b for _, b in pl])) if pl else None)
    data.update(served_vs_full=match_full, served_vs_local=match_local)
    tol = 1e-6
    served_local = [c for c, (f, l) in enumerate(zip(match_full, match_local))
                    if l is not None and l <= tol and (f is None or f > tol)]
    served_full = [c for c, f in enumerate(match_full) if f is not None and f <= tol]
    for c, (f, l) in enumerate(zip(match_full, match_local)):
        rows.append({"rank": f"served chunk {c}", "rel_diff vs all-reduced embedding": f,
                     "rel_diff vs rank-0 local embedding": l})
    if served_local:
        data["short"] = (f"aux chunk {served_local[0]} is a rank-local embedding, not all-reduced "
                         "across TP ranks")
        verdict = "confirmed"
        text = (f"Served chunk {served_local[0]} equals rank 0's *local* embedding: rows of token ids "
                f"outside rank 0's vocab shard are zero. The embedding reaches the draft before the "
                f"all-reduce of VocabParallelEmbedding, i.e. a partial sum over {tp} ranks.")
    else:
        verdict = "refuted"
        where = (f"Served chunk {served_full[0]} is the full, all-reduced embedding. " if served_full
                 else "No served chunk is an embedding at all. ")
        text = (f"VocabParallelEmbedding does all-reduce: on each of the {len(full)} rank(s) the module "
                "output is identical and equals the sum of the rank-local lookups, whose rows are zero "
                f"exactly for token ids outside the rank's vocab shard. {where}Whatever is wrong, it is "
                "not a missing all-reduce.")
    fig = bar_figure([f"rank {r}" for r in range(len(per_rank_zero))], per_rank_zero,
               "Share of zero rows in each rank's local (pre-all-reduce) embedding", "fraction")
    return HypothesisResult("embedding_all_reduce", "Embedding all-reduce", "", verdict, text,
                            pd.DataFrame(rows), fig, data)


def _vocab_shard_mask(ids: torch.Tensor, vocab: int, rank: int, tp: int) -> torch.Tensor:
    """Token ids of ``rank``'s vocab shard, with SGLang's padding of the vocab to a multiple of
    64 (``sglang/srt/layers/vocab_parallel_embedding.py::pad_vocab_size``)."""
    padded = (vocab + 63) // 64 * 64
    per = padded // tp
    return (ids >= rank * per) & (ids < min((rank + 1) * per, vocab))


def check_layer_offset(inv: Investigation, **_: Any) -> HypothesisResult:
    """Is every aux chunk one (or k) layer(s) off from what the draft was trained on?"""
    frame = _chunk_frame(inv)
    shifts = []
    for _, r in frame.iterrows():
        m, t = layer_index(r["measured (reference)"]), layer_index(r["trained"])
        shifts.append(None if m is None or t is None else m - t)
    frame["shift (measured - trained)"] = shifts
    known = [s for s in shifts if s is not None]
    data = {"shifts": shifts, "measured": list(frame["measured (reference)"]),
            "trained": list(frame["trained"])}
    if not known:
        verdict, text = "inconclusive", "No chunk could be identified against the reference layers."
    elif all(s == 0 for s in known) and len(known) == len(shifts):
        verdict = "refuted"
        text = ("Every chunk is the layer the draft was trained on (identified against all layers of the "
                "target for the same tokens): no offset.")
    elif len(set(known)) == 1 and known[0] != 0 and len(known) == len(shifts):
        data["short"] = f"every aux chunk is {known[0]:+d} layer(s) off from the trained layers"
        verdict = "confirmed"
        text = (f"Every chunk is shifted by {known[0]:+d} layer(s) from training (e.g. "
                f"{frame['measured (reference)'][0]} instead of {frame['trained'][0]}): a layer-id "
                "convention mismatch (SGLang adds +1 to explicit ids; vLLM/speculators do not).")
    else:
        verdict = "refuted"
        text = ("The chunks are not off by one constant amount (shifts " +
                ", ".join("?" if s is None else f"{s:+d}" for s in shifts) +
                "): this is not a layer-id convention offset; see the chunk table for what each "
                "chunk really is.")
    fig = chunk_layer_figure(frame, "Layer of each aux chunk (-1 = embedding)")
    return HypothesisResult("layer_offset", "Layer offset", "", verdict, text, frame, fig, data)


def check_concat_order(inv: Investigation, **_: Any) -> HypothesisResult:
    """Does the engine concatenate the captured layers in another order than configured?

    Only the chunks whose measured tensor is one of the configured tensors are compared: a chunk
    whose *content* is something else (an embedding, another layer) is a different fault, not an
    ordering one."""
    frame = _chunk_frame(inv)
    configured = list(frame["configured"])
    measured = list(frame["measured (reference)"])
    data = {"configured": configured, "measured": measured}
    comparable = [(i, m) for i, m in enumerate(measured) if m is not None and m in configured]
    moved = [(i, m, configured.index(m)) for i, m in comparable if configured.index(m) != i]
    frame["position configured for this tensor"] = [configured.index(m) if m in configured else None
                                                    for m in measured]
    if not comparable:
        verdict = "inconclusive"
        text = ("No served chunk could be matched to a configured tensor, so the order cannot be "
                "judged; see the layer and embedding checks.")
        short = ""
    elif moved and not all(m is not None and m in configured for m in measured):
        shifts = {None if layer_index(m) is None or layer_index(c) is None else layer_index(m) - layer_index(c)
                  for m, c in zip(measured, configured)}
        i, m, j = moved[0]
        short = ""
        if len(shifts) == 1 and None not in shifts:
            verdict = "refuted"
            text = (f"Every chunk is the configured layer shifted by {shifts.pop():+d}: chunk {i} holds {m}, which "
                    f"the config puts at position {j}, only because the whole set moved. That is a layer offset, "
                    "not a reordering (see the layer offset check).")
        else:
            verdict = "inconclusive"
            text = (f"Chunk {i} holds {m}, configured at position {j}, but other chunks hold tensors the config does "
                    f"not name (served [{', '.join(map(str, measured))}] vs configured [{', '.join(configured)}]): "
                    "the content is wrong, so the order alone cannot be judged; the layer checks explain it.")
    elif moved:
        verdict = "confirmed"
        i, m, j = moved[0]
        text = (f"The served chunks are the configured tensors in another order: chunk {i} holds {m}, "
                f"configured at position {j} (served [{', '.join(map(str, measured))}] vs configured "
                f"[{', '.join(configured)}]). SGLang captures in ascending layer order, whatever order "
                "the config lists.")
        short = f"chunk {i} holds {m}, configured at position {j}"
    else:
        verdict = "refuted"
        other = [i for i, m in enumerate(measured) if m not in configured]
        tail = (f" (chunk{'s' if len(other) > 1 else ''} {', '.join(map(str, other))} hold"
                f"{'' if len(other) > 1 else 's'} other content, which the other checks explain)"
                if other else "")
        plan = inv.diagnosis().served_plan
        ids = (plan.engine_ids or plan.config_ids) if plan is not None else None
        if ids is not None and list(ids.ids) != sorted(ids.ids):
            sglang = plan.who.startswith("sglang")
            engine = "SGLang" if sglang else "vLLM" if plan.who.startswith("vllm") else "the engine"
            stored = f"{engine}'s layers_to_capture" if sglang else "the engine's capture indices"
            text = (f"The order is the one {engine}'s rules predict: every chunk that holds a configured tensor sits "
                    f"at the position the engine's plan gives it{tail}. The config lists {plan.config_ids}"
                    + (f" ({stored} {list(ids.ids)})" if plan.engine_ids else "")
                    + f", not in layer order: {engine} captures inside its layer loop, so the chunks come in "
                      "ascending layer order, as its rules predict and as measured. The engine's reordering "
                      "is not the fault.")
        else:
            text = ("The order is as configured: every chunk that holds a configured tensor sits at the "
                    f"position the config gives it{tail}. The engine concatenates in ascending layer "
                    "order, which here is the configured order.")
        short = ""
    fig = chunk_layer_figure(frame, "Aux chunk order: configured vs served (-1 = embedding)",
                              with_configured=True)
    return HypothesisResult("concat_order", "Concatenation order", "", verdict, text, frame, fig,
                            {**data, "short": short})


def check_embedding_included(inv: Investigation, **_: Any) -> HypothesisResult:
    """Is the embedding fed to the draft where training had none?"""
    frame = _chunk_frame(inv)
    d = inv.diagnosis()
    trained = list(frame["trained"])
    emb_chunks = [int(r["chunk"]) for _, r in frame.iterrows() if r["measured (reference)"] == "embedding"]
    found = [f for f in d.findings if f["kind"] == "embedding_in_place_of_layer"]
    data = {"embedding_chunks": emb_chunks, "training_has_embedding": "embedding" in trained,
            "findings": [f["kind"] for f in d.findings]}
    if emb_chunks and "embedding" not in trained:
        c = emb_chunks[0]
        data["short"] = (f"the token embedding was fed to the draft as aux chunk {c}, where it was "
                         f"trained on {trained[c]}")
        verdict = "confirmed"
        text = (f"Served chunk {c} is the token embedding (identical to the target's embedding output for "
                f"the same tokens; rows of equal token ids are equal), but the draft was trained on "
                f"{trained[c]} there and never saw the embedding. Same total width, so nothing crashes: "
                "the draft's fc just reads the wrong features and acceptance collapses.")
    elif emb_chunks:
        verdict, text = "refuted", "The embedding is served, and training used it too."
    else:
        verdict, text = "refuted", "No served chunk is the embedding."
    if found:
        data["finding_detail"] = found[0]["detail"]
    fig = chunk_layer_figure(frame, "Which aux chunk is the embedding (-1 = embedding)")
    return HypothesisResult("embedding_included", "Embedding in place of a layer", "", verdict, text,
                            frame, fig, data)


def check_num_steps_override(inv: Investigation, **_: Any) -> HypothesisResult:
    """Did SGLang silently change num_steps / num_draft_tokens from what was asked?"""
    spec = inv.spec_config()
    rows = [{"setting": k, "requested": getattr(spec.requested, k), "effective": getattr(spec.effective, k)}
            for k in ("algorithm", "num_steps", "topk", "num_draft_tokens", "max_running_requests")]
    hits = [o for o in spec.overrides if o.field in ("speculative_num_draft_tokens", "speculative_num_steps",
                                                    "speculative_eagle_topk")]
    data = {"overrides": [o.model_dump() for o in spec.overrides], "requested_from": spec.requested_from}
    if hits:
        data["short"] = "SGLang silently overrode " + ", ".join(o.field for o in hits)
        verdict = "confirmed"
        text = " ".join(o.message for o in hits)
    elif spec.requested_from == "none":
        verdict = "inconclusive"
        text = "What was requested is unknown (the server reports no launch command; pass requested=)."
    else:
        verdict = "refuted"
        text = (f"The server runs what was asked: {spec.effective.num_steps} steps, topk "
                f"{spec.effective.topk}, {spec.effective.num_draft_tokens} draft tokens.")
    return HypothesisResult("num_steps_override", "num_steps / draft tokens override", "", verdict, text,
                            pd.DataFrame(rows), None, data)


def check_fc_bypass(inv: Investigation, **_: Any) -> HypothesisResult:
    """Is an EAGLE-3 draft served with ``--speculative-algorithm EAGLE`` (one H-wide state: the fc
    over the aux chunks is silently skipped)?"""
    spec = inv.spec_config()
    algo = spec.effective.algorithm
    archs = spec.draft_architectures or []
    eagle3_draft = any("Eagle3" in a for a in archs)
    width = None
    try:
        width = int(inv.tensors(inv.served_dump())[0]["hidden"].shape[1])
    except Exception:  # noqa: BLE001 - evidence only
        pass
    rows = [{"measure": "speculative_algorithm", "value": algo},
            {"measure": "draft architectures", "value": ", ".join(archs)},
            {"measure": "served row width", "value": width},
            {"measure": "hidden size H", "value": inv.hidden_size}]
    data = {"algorithm": algo, "draft_architectures": archs, "width": width}
    if algo == "EAGLE" and eagle3_draft:
        data["short"] = "an EAGLE-3 draft was served with algorithm EAGLE, so its fc was bypassed"
        verdict = "confirmed"
        text = (f"The server runs algorithm EAGLE with an EAGLE-3 draft: the target feeds one "
                f"{width}-wide state (its last, normed hidden state) instead of the aux layers, and "
                "llama_eagle3.py skips fc when the width equals the draft's hidden size.")
    elif algo == "EAGLE3":
        verdict, text = "refuted", "The server runs EAGLE3, so the aux states pass through the draft's fc."
    else:
        verdict, text = "inconclusive", f"Algorithm {algo!r} with draft {archs}."
    return HypothesisResult("fc_bypass", "fc bypassed (algorithm EAGLE)", "", verdict, text,
                            pd.DataFrame(rows), None, data)


def check_verify_bottleneck(inv: Investigation, *, ratio_threshold: float = 1.5, **_: Any) -> HypothesisResult:
    """Once acceptance is fixed, does the verify step's cost bound tok/s? Compares the time per
    verify step (spec server) with the time per decode step of the target alone."""
    acc, base = inv.acceptance, inv.baseline
    if not acc or not base:
        return HypothesisResult("verify_bottleneck", "Verify time is the bottleneck", "", "inconclusive",
                                "Needs an acceptance measurement of this server and of a target-only "
                                "baseline (a fix with baseline: true).", pd.DataFrame(), None, {})
    tau = float(acc["accept_length"])
    verify_ms = 1e3 / (float(acc["tok_s"]) / tau)           # seconds per verify step
    decode_ms = 1e3 / float(base["tok_s"])                  # seconds per decode token
    r = verify_ms / decode_ms
    speedup = float(acc["tok_s"]) / float(base["tok_s"])
    rows = [{"measure": "accept length (tokens per verify step)", "value": tau},
            {"measure": "ms per verify step (spec server)", "value": verify_ms},
            {"measure": "ms per decode step (target only)", "value": decode_ms},
            {"measure": "verify / decode cost ratio", "value": r},
            {"measure": "tok/s speedup measured", "value": speedup},
            {"measure": "speedup if a verify step cost one decode step", "value": tau}]
    data = {"accept_length": tau, "verify_ms": verify_ms, "decode_ms": decode_ms, "ratio": r,
            "speedup": speedup}
    if r >= ratio_threshold:
        data["short"] = f"a verify step costs {r:.2f}x a decode step, which bounds tok/s"
        verdict = "confirmed"
        text = (f"A verify step costs {r:.2f}x a plain decode step ({verify_ms:.1f} vs {decode_ms:.1f} ms), "
                f"so {tau:.2f} tokens per verify step give only {speedup:.2f}x tok/s. Verify (and draft) "
                "time, not acceptance, now bounds throughput: fewer draft steps or cheaper verify.")
    else:
        verdict = "refuted"
        text = (f"A verify step costs {r:.2f}x a decode step; tok/s follows acceptance "
                f"({speedup:.2f}x at accept length {tau:.2f}).")
    fig = bar_figure(["verify step", "decode step"], [verify_ms, decode_ms], "Time per step", "ms")
    return HypothesisResult("verify_bottleneck", "Verify time is the bottleneck", "", verdict, text,
                            pd.DataFrame(rows), fig, data)


def _fmt_al(stage: Optional[dict]) -> str:
    """``2.91 [2.60, 3.20]`` of a budget stage (accept length with its 95 % CI), or ``n/a``."""
    if not stage or stage.get("accept_length") is None:
        return "n/a"
    lo, hi = (stage.get("ci") or [None, None])[:2]
    return f"{stage['accept_length']:.2f}" + (f" [{lo:.2f}, {hi:.2f}]" if lo is not None and hi is not None else "")


def check_draft_standalone(inv: Investigation, *, samples: Optional[int] = None, **_: Any) -> HypothesisResult:
    """The seeds' standalone test of the draft: run alone, outside the server (pure torch, as SGLang 0.5.23 runs it:
    :mod:`helpers.draft`), does the checkpoint do what its training log says? The hypothesis of a fault is "the
    draft itself underperforms": ``confirmed`` when the acceptance budget's draft loss (the log's accept length
    minus the checkpoint's, teacher-forced on rows of the log's kind, like with like) counts, ``refuted`` when it is
    clear, ``inconclusive`` when undecided (no log, unlike rows, too few rows).

    Also run, for the explanation: the draft's drafting chain on the training data's aux states and, with a live
    server, on the states the server feeds for the same tokens (the wiring stage: what the seeds concluded from
    their standalone test, "the problem is in the wiring"). The server's effective ``(steps, topk, draft tokens)``
    are the settings (3 / 1 / 4 without a server).

    Args:
        samples: training samples the drafting chain runs on (default: the investigation's ``num_samples``).
    """
    info: dict = {}
    served = None
    if inv.client is not None:
        try:
            info = inv.server_info()
            served = inv.served_dump()
        except Exception:  # noqa: BLE001 - a server that died at startup: the draft alone still runs
            info, served = {}, None
    steps = int(info.get("speculative_num_steps") or 3)
    topk = int(info.get("speculative_eagle_topk") or 1)
    ndt = int(info.get("speculative_num_draft_tokens") or (steps + 1 if topk == 1 else 2 * steps))
    settings = DraftSettings(steps, topk, ndt).check()
    choice = choose_dtype(server_dtype(info, read_draft_config(inv.draft_dir).raw), "cpu")
    off = offline_inputs(inv.draft_dir, inv.target_dir, inv.training, hidden_size=inv.hidden_size, choice=choice,
                         samples=samples or inv.num_samples, served=served)
    b = acceptance_budget(off.draft, off.budget_inputs(settings),
                          required=("draft",) + (("wiring",) if off.served else ()))
    st = {x["name"]: x for x in b["stages"]}
    log, ck = st.get("training log"), st.get("checkpoint (teacher-forced)")
    tr, sv = st.get("offline on training states"), st.get("offline on served states")
    dl, wl = b["losses"].get("draft") or {}, b["losses"].get("wiring") or {}
    rows = [{"stage": n, "accept length": (st.get(n) or {}).get("accept_length"),
             "ci low": ((st.get(n) or {}).get("ci") or [None, None])[0],
             "ci high": ((st.get(n) or {}).get("ci") or [None, None])[1], "source": (st.get(n) or {}).get("source")}
            for n in ("training log", "checkpoint (teacher-forced)", "offline on training states",
                      "offline on served states") if n in st]
    per_step = "; ".join(f"step {r['step']}: {r['acc']:.3f} vs log {r['log_acc']:.3f}"
                         for r in (ck or {}).get("table") or [])
    data = {"settings": b["settings"], "stages": [{k: x.get(k) for k in ("name", "accept_length", "ci")}
                                                  for x in b["stages"]],
            "draft_loss": {k: dl.get(k) for k in ("delta", "ci", "decision", "basis")},
            "wiring_loss": {k: wl.get(k) for k in ("delta", "ci", "decision", "basis")} if sv is not None else None,
            "draft_sources": b.get("draft_sources")}
    run_alone = (f"Run alone ({settings.label}, compute dtype {choice.reason}), the checkpoint teacher-forced on "
                 f"{((ck or {}).get('rows') or {}).get('sequences', 0)} row(s) of its log's kind scores "
                 f"{per_step or 'no step'}: accept length {_fmt_al(ck)} against the log's {_fmt_al(log)}")
    chain = f"; its drafting chain on the training states accepts {_fmt_al(tr)} tokens per verify step"
    if sv is not None:
        chain += (f", on the states this server feeds for the same tokens {_fmt_al(sv)} (wiring loss "
                  f"{wl.get('delta', float('nan')):+.2f}, {wl.get('decision')})")
    decision = dl.get("decision")
    if decision == "counts":
        verdict = "confirmed"
        data["short"] = f"the draft alone scores below its training log (accept length {_fmt_al(ck)} vs {_fmt_al(log)})"
        text = run_alone + chain + ". The checkpoint itself underperforms its log: look at the draft (export, " \
                                   "weights, vocab map) before the server."
    elif decision == "clear":
        verdict = "refuted"
        where = (" What the server feeds it costs acceptance: the fault is in the wiring between the server and the "
                 "draft." if wl.get("decision") == "counts" else "")
        text = run_alone + chain + ". The draft is as good as its training log says." + where
    else:
        verdict = "inconclusive"
        text = run_alone + chain + f". Whether the draft itself is at fault is undecided: {dl.get('basis') or ''}"
    names = [r["stage"] for r in rows]
    fig = bar_figure(names, [r["accept length"] for r in rows], "The draft run alone: accept length by stage",
                     "tokens per verify step")
    return HypothesisResult("draft_standalone", "Standalone draft test", "", verdict, text, pd.DataFrame(rows), fig,
                            data)


def static_findings(inv: Investigation, trained_layer_ids: Optional[Sequence[int]] = None):
    """The static wiring check (:func:`helpers.diagnosis.static.static_check`, the one implementation) for this
    investigation's draft and target, the server's version and algorithm when it is up, and the training data's
    manifest. Returns the :class:`~helpers.diagnosis.static.StaticReport`."""

    info = {}
    if inv.client is not None:
        try:
            info = inv.server_info()
        except Exception:  # noqa: BLE001 - a server that died at startup: configs alone
            info = {}
    algorithm = info.get("speculative_algorithm") or inv.algorithm or "EAGLE3"
    return static_check(inv.draft_dir, inv.target_dir, sglang_version=info.get("version"), algorithm=algorithm,
                        server=info or None, training=inv.training if inv.training.exists() else None,
                        trained_layer_ids=trained_layer_ids, rules=inv.rules)


def check_static_wiring(inv: Investigation, trained_layer_ids: Optional[Sequence[int]] = None,
                        **_: Any) -> HypothesisResult:
    """From the configs alone (works when the server crashed at startup): will the engine feed
    the draft the tensors it was trained on?

    Args:
        trained_layer_ids: the ids the training run used, SpecForge output-of-layer convention
            (default: the training data's ``capture.json``, else the draft config).
    """
    rep = static_findings(inv, trained_layer_ids)
    sp, tp, findings = rep.served_plan, rep.training_plan, rep.findings
    rows = [{"finding": f["kind"], "chunk": f["chunk"], "detail": f["detail"]} for f in findings]
    trained = list(tp.tensors) if tp is not None else []
    src = f"{tp.provenance}: {tp.source}" if tp is not None else "unknown"
    data = {"served_plan": list(sp.tensors), "training_plan": trained, "findings": [f["kind"] for f in findings],
            "fatal": sp.fatal, "trained_ids_source": src, "static_verdict": rep.verdict,
            "ambiguity": rep.ambiguity, "advisories": rep.advisories}
    head = (f"Configured, the engine feeds [{', '.join(sp.tensors)}]; the draft was trained on "
            f"[{', '.join(trained)}] ({src}).")
    if findings:
        data["short"] = findings[0]["detail"].split(". ")[0]
        verdict = "confirmed"
        text = head + " " + " ".join(f"{f['kind']}: {f['detail']}" for f in findings[:3])
        if sp.fatal:
            text += f" The engine cannot serve this: {sp.fatal}"
    elif rep.verdict == "ambiguous":
        verdict = "inconclusive"
        text = (head + " The draft config's ids can mean two things: " + "; ".join(
            f"{r['reading']} -> {r['outcome']}" for r in rep.ambiguity["readings"]) + ". To settle it: "
            + rep.ambiguity["settle"])
    else:
        verdict = "refuted"
        text = head + " The configs agree: no static wiring fault."
    return HypothesisResult("static_wiring", "Static wiring check", "", verdict, text,
                            pd.DataFrame(rows), None, data)


def check_vocab_map(inv: Investigation, **_: Any) -> HypothesisResult:
    """Is the draft's pruned vocabulary mapped to target token ids (``d2t``)?"""

    draft = read_draft_config(inv.draft_dir)
    weights = read_draft_weights(inv.draft_dir)
    found = detect_vocab_map_missing(draft, weights)
    rows = [{"measure": "draft_vocab_size", "value": draft.draft_vocab_size},
            {"measure": "target vocab_size", "value": draft.vocab_size},
            {"measure": "d2t in the draft weights", "value": weights.d2t_shape is not None},
            {"measure": "t2d in the draft weights", "value": weights.t2d_shape is not None}]
    data = {"draft_vocab_size": draft.draft_vocab_size, "vocab_size": draft.vocab_size,
            "d2t": weights.d2t_shape is not None}
    if found:
        data["short"] = "the draft's pruned vocabulary has no d2t map, so draft token ids are read as target ids"
        verdict, text = "confirmed", found[0]["detail"] + (
            ". SGLang builds hot_token_id from d2t (llama_eagle3.py load_weights); without it the "
            "draft proposes ids of its own vocabulary as if they were target ids, and almost none "
            "verify.")
    else:
        verdict = "refuted"
        text = ("The draft vocabulary is mapped: d2t is present"
                if weights.d2t_shape is not None else "The draft uses the full target vocabulary") + "."
    return HypothesisResult("vocab_map", "Vocab map (d2t)", "", verdict, text, pd.DataFrame(rows),
                            None, data)


def _check_finding_kind(inv: Investigation, kind: str, title: str, what: str) -> HypothesisResult:
    """A hypothesis the diagnosis answers directly: confirmed when it names ``kind`` (with the fitted evidence),
    refuted when every served chunk is explained (equal to a training chunk, or identified as another tensor
    against the reference), else inconclusive naming what is missing."""
    d = inv.diagnosis()
    frame = _chunk_frame(inv)
    hits = [f for f in d.findings if f["kind"] == kind]
    data: dict[str, Any] = {"findings": [f["kind"] for f in d.findings]}
    if hits:
        f = hits[0]
        data["short"] = f["detail"]
        data["evidence"] = f["evidence"]
        return HypothesisResult(kind, title, "", "confirmed", f["detail"], frame, None, data)
    unexplained = [int(ch["index"]) for ch in d.chunks
                   if ch.get("matched_training_chunk") is None and not ch.get("identified_as")]
    if not unexplained:
        return HypothesisResult(kind, title, "", "refuted",
                                f"Every served chunk is explained without {what}: it equals a training chunk on the "
                                "aligned rows, or is identified as another tensor of the target.", frame, None, data)
    return HypothesisResult(kind, title, "", "inconclusive",
                            f"Chunk(s) {unexplained} match neither a training chunk nor a reference layer, and the "
                            f"fit found no {what}; an every-layer reference (server --capture-layers, or HF on the "
                            "target) would say what they hold.", frame, None, data)


def check_rotated_basis(inv: Investigation, **_: Any) -> HypothesisResult:
    """Is a served chunk the trained tensor in another orthonormal basis? (helpers.diagnosis.fit.isometry_fit)"""
    return _check_finding_kind(inv, "rotated_basis", "Rotated basis", "rotation")


def check_norm_mismatch(inv: Investigation, **_: Any) -> HypothesisResult:
    """Is a served chunk the trained tensor with an RMS norm applied or missing? (helpers.diagnosis.fit.rms_norm_fit)"""
    return _check_finding_kind(inv, "norm_mismatch", "Missing or extra norm", "normalisation")


@dataclass(frozen=True)
class Check:
    """A declared check (:class:`helpers.investigation.catalog.CheckSpec`) with its function ``check_<name>``."""

    name: str
    title: str
    question: str
    fn: Callable[..., HypothesisResult]


def _implementation(name: str) -> Callable[..., HypothesisResult]:
    fn = globals().get(f"check_{name}")
    if fn is None:                                                                      # pragma: no cover
        raise RuntimeError(f"helpers/investigation/catalog.py declares the check {name!r}, but "
                           f"helpers/investigation/checks.py has no check_{name}")
    return fn


#: name -> :class:`Check`, one per :data:`helpers.investigation.catalog.CHECK_SPECS` entry
CHECKS: dict[str, Check] = {s.name: Check(s.name, s.title, s.question, _implementation(s.name)) for s in CHECK_SPECS}


def run_check(name: str, inv: Investigation, *, label: str = "", question: str = "",
              params: Optional[dict] = None) -> HypothesisResult:
    """Run check ``name`` on ``inv``; any exception becomes an ``inconclusive`` verdict naming it."""
    check = CHECKS[name]
    try:
        res = check.fn(inv, **(params or {}))
    except Exception as exc:  # noqa: BLE001 - a check that cannot run is inconclusive, not a crash
        res = HypothesisResult(name, check.title, "", "inconclusive",
                               f"The check could not run: {type(exc).__name__}: {exc}",
                               pd.DataFrame(), None, {"error": f"{type(exc).__name__}: {exc}"})
    res.title = res.title or check.title
    res.question = question or check.question
    res.label = label
    return res
