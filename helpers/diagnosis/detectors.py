"""Named wiring faults: one function per finding kind, each returning findings with evidence.

A finding is ``{"kind": str, "chunk": int|None, "detail": str, "evidence": {...}}`` (DESIGN.md
"Findings"); ``kind`` is one of :data:`helpers.kinds.FINDING_KINDS` (the contract with helpers/hooks.py fault injection).
``chunk`` is the served chunk index (None for findings about the whole width, the config, or training data).

Detectors come in two groups:

* static (no tensors): :func:`detect_config_ids_ignored`, :func:`detect_fc_bypassed` (server algorithm part),
  :func:`detect_vocab_map_missing`, :func:`detect_num_draft_tokens_overridden`, and the plan comparison
  used by :func:`static_layer_findings` (width, chunk count, layers);
* numeric, on a :class:`helpers.diagnosis.compare.Comparison` wrapped in a :class:`Context` (which computes the
  chunk correspondence once): every other kind.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Optional

import numpy as np
import torch

from ..kinds import ALIGNED_KINDS, FINDING_KINDS, LAYOUT_KINDS  # noqa: F401  (re-exported)
from ..runfiles import jsonable
from .compare import MATCH_SHARE, Comparison, PairMetrics, SourceResult
from .conventions import (
    EMBEDDING,
    FINAL_NORM,
    CapturePlan,
    LayerIds,
    compare_plans,
    describe,
    layer_of,
    sglang_default_capture,
)
from .fit import isometry_fit, noise_floor, rms_norm_fit, scale_fit

def finding(kind: str, chunk: Optional[int], detail: str, **evidence: Any) -> dict:
    """Build a finding dict; ``kind`` must be declared in :mod:`helpers.kinds`.

    Raises:
        ValueError: unknown kind.
    """
    if kind not in FINDING_KINDS:
        raise ValueError(f"unknown finding kind {kind!r}")
    return {"kind": kind, "chunk": chunk, "detail": detail, "evidence": jsonable(evidence, sig=6, keep_inf=True)}



# ================================================================================================ static

def detect_config_ids_ignored(draft, target, served: Optional[CapturePlan] = None) -> list[dict]:
    """``config_ids_ignored``: ids sit at the top level of the draft config (speculators / vLLM style) with no
    nested ``eagle_config``; SGLang reads only ``eagle_config.eagle_aux_hidden_state_layer_ids`` inside a bare
    ``try/except`` and silently uses its default (``spec_aux_hidden_state.py::_resolve_eagle_aux_hidden_state``).

    Reported only when the ignored ids name other tensors than the default SGLang then captures (ids read
    in the convention of the config's form: speculators form = vllm in(i), SGLang/SpecForge form = out(i)).
    """
    if draft is None or target is None or draft.top_level_layer_ids is None or draft.nested_layer_ids is not None:
        return []

    n = target.num_hidden_layers
    conv = "vllm" if draft.form == "speculators" else "specforge"
    meant = []
    for i in sorted(set(draft.top_level_layer_ids)):
        try:
            meant.append(LayerIds((i,), conv).tensors(n)[0])
        except ValueError:
            meant.append(f"<{conv} id {i}: no such tensor>")
    default = served.tensors if served is not None else sglang_default_capture(n).tensors(n)
    if meant == list(default):
        return []
    return [finding("config_ids_ignored", None,
                    f"draft config has top-level eagle_aux_hidden_state_layer_ids {list(draft.top_level_layer_ids)} "
                    f"but no eagle_config: SGLang ignores them and captures its default {describe(default)} instead "
                    f"of {describe(meant)}",
                    config=str(draft.path), top_level_ids=list(draft.top_level_layer_ids), read_as=conv,
                    meant=meant, served=list(default),
                    source="sglang/srt/model_executor/model_runner_components/spec_aux_hidden_state.py::"
                           "_resolve_eagle_aux_hidden_state",
                    fix='move the ids under "eagle_config": {"eagle_aux_hidden_state_layer_ids": [...]} '
                        "(in SpecForge out(i) numbering)")]


def detect_vocab_map_missing(draft, weights) -> list[dict]:
    """``vocab_map_missing``: ``draft_vocab_size < vocab_size`` but the weights carry no ``d2t``; SGLang then
    has no ``hot_token_id`` and the draft's top-k ids are not mapped to target ids
    (``sglang/srt/models/llama_eagle3.py::load_weights``; ``eagle_worker_v2.py::draft_forward``)."""
    if draft is None or weights is None:
        return []
    dv, v = draft.draft_vocab_size, draft.vocab_size
    if dv is None or v is None or dv >= v or weights.d2t_shape is not None:
        return []
    return [finding("vocab_map_missing", None,
                    f"pruned draft vocab ({dv} < target vocab {v}) but no d2t tensor in the draft weights: draft "
                    "token ids would be used as target ids",
                    draft_vocab_size=dv, vocab_size=v, weights=[str(f) for f in weights.files],
                    t2d_present=weights.t2d_shape is not None,
                    source="sglang/srt/models/llama_eagle3.py::LlamaForCausalLMEagle3.load_weights (d2t -> "
                           "hot_token_id; t2d ignored)")]


def detect_num_draft_tokens_overridden(server) -> list[dict]:
    """``num_draft_tokens_overridden``: with ``--speculative-eagle-topk 1`` SGLang resets
    ``speculative_num_draft_tokens`` to ``speculative_num_steps + 1`` and only logs a warning
    (``sglang/srt/arg_groups/speculative_hook.py::_handle_eagle_family``, 0.5.23)."""
    if server is None:
        return []
    req = server.requested or {}
    algo = (req.get("speculative_algorithm") or server.algorithm or "").upper()
    if algo and algo not in ("EAGLE", "EAGLE3", "NEXTN"):
        return []
    topk = req.get("speculative_eagle_topk", server.topk)
    steps = req.get("speculative_num_steps", server.num_steps)
    ndt = req.get("speculative_num_draft_tokens")
    if topk != 1 or steps is None or ndt is None or ndt == steps + 1:
        return []
    return [finding("num_draft_tokens_overridden", None,
                    f"--speculative-num-draft-tokens {ndt} with topk 1 is overridden to num_steps+1 = {steps + 1}",
                    requested=ndt, effective=server.num_draft_tokens if server.num_draft_tokens is not None
                    else steps + 1, num_steps=steps, topk=topk,
                    source="sglang/srt/arg_groups/speculative_hook.py::_handle_eagle_family",
                    log='"speculative_num_draft_tokens is adjusted to speculative_num_steps + 1 when '
                        'speculative_eagle_topk == 1"')]


def detect_fc_bypassed(draft=None, server=None, ctx: Optional["Context"] = None, weights=None,
                       target=None) -> list[dict]:
    """``fc_bypassed``: an EAGLE-3 draft receives one H-wide state (``--speculative-algorithm EAGLE``/NEXTN, or
    ``use_aux_hidden_state: false``) as wide as its own hidden size, so ``llama_eagle3.py`` skips ``fc``
    (``if hidden_states.shape[-1] != embeds.shape[-1]``) and the draft runs on features it never saw.

    Static evidence: the server's algorithm / the config flag, and the fed width: the target's ``hidden_size``
    (``target``; else the draft's ``target_hidden_size``). When the fed width differs from the draft's hidden
    size, fc runs on it: fine when fc takes that width (no finding: a layout question), otherwise a shape error
    at the first draft forward, returned as a static ``width_mismatch`` whose evidence carries ``fatal`` (the
    server does not serve). Numeric evidence (``ctx``): the served width equals the draft hidden size while fc
    expects more.
    """
    if draft is None or not draft.is_eagle3:
        return []
    fc_in = weights.fc_shape[1] if weights is not None and weights.fc_shape else draft.sglang_fc_in_features
    algo = server.algorithm if server is not None else None
    static_cause = (f"--speculative-algorithm {algo}" if algo in ("EAGLE", "NEXTN") else
                    "eagle_config.use_aux_hidden_state=false" if draft.use_aux_hidden_state is False else None)
    ev: dict = {"draft_hidden_size": draft.hidden_size, "fc_in_features": fc_in,
                "source": "sglang/srt/models/llama_eagle3.py::LlamaModel.forward (fc only if width != embeds width)"}
    if ctx is not None:
        served_w = ctx.cmp.served_width
        if not (served_w == draft.hidden_size and served_w < fc_in):
            return []
        ev["served_width"] = served_w
        ident = ctx.cmp.identify(ctx.source.ref, 0)
        if ident:
            ev["served_identified_as"] = ident["best"]
        cause = static_cause or f"the server feeds one {served_w}-wide state"
    else:
        if static_cause is None:
            return []
        fed = target.hidden_size if target is not None else draft.sglang_hidden_size_in
        if fed != draft.hidden_size:
            if target is None or fc_in == fed:
                return []
            msg = (f"{static_cause}: the server feeds one {fed}-wide state ({FINAL_NORM}, the target's hidden size); "
                   f"it differs from the draft's embedding width {draft.hidden_size}, so llama_eagle3.py applies fc, "
                   f"which takes {fc_in}: shape error (RuntimeError, mat1 and mat2 shapes cannot be multiplied) at the "
                   f"first draft forward -- {ev['source']}")
            return [finding("width_mismatch", None, msg, static=True, fatal=msg, fed_width=fed,
                            draft_hidden_size=draft.hidden_size, fc_in_features=fc_in,
                            target_config_hidden_size=fed, source=ev["source"])]
        ev["fed_width"] = fed
        cause = static_cause
    if static_cause:
        ev["speculative_algorithm"] = algo
        ev["use_aux_hidden_state"] = draft.use_aux_hidden_state
    return [finding("fc_bypassed", None,
                    f"{cause}: the EAGLE-3 draft gets a single H-wide hidden state instead of "
                    f"{fc_in // max(1, draft.sglang_hidden_size_in)} aux chunks, so SGLang skips fc silently", **ev)]


def static_layer_findings(served: CapturePlan, trained: Optional[CapturePlan], draft=None, weights=None,
                          target=None) -> list[dict]:
    """Static layer / width findings from the two capture plans and the draft's fc (no tensors).

    * ``width_mismatch``: fc ``in_features`` (weights) vs SGLang's Linear(``hidden_size_in * num_aux``)
      (config), and vs the served plan's chunk count x target H;
    * ``missing_chunk`` / ``extra_chunk`` / ``layer_offset`` / ``wrong_layer`` / ``chunk_order`` /
      ``embedding_in_place_of_layer``: position-wise comparison of the served and training plans (the
      plans' own problems, e.g. an unreachable capture index, are attached as evidence).
    """
    out: list[dict] = []
    H = target.hidden_size if target is not None else None
    if draft is not None and H is not None and served.tensors and served.tensors != [FINAL_NORM]:
        fc_in = weights.fc_shape[1] if weights is not None and weights.fc_shape else None
        built = draft.sglang_fc_in_features
        served_w = served.num_chunks * H
        if fc_in is not None and fc_in != built:
            out.append(finding("width_mismatch", None,
                               f"fc.weight has in_features {fc_in} but SGLang builds Linear({built}) "
                               f"(= {draft.sglang_hidden_size_in} x {draft.sglang_num_aux}; "
                               f"target_hidden_size {'missing' if draft.target_hidden_size is None else 'set'}): "
                               "the weights will not load or the width is wrong",
                               static=True, fc_in_features=fc_in, sglang_fc_in_features=built,
                               draft_hidden_size=draft.hidden_size, target_hidden_size=draft.target_hidden_size,
                               target_config_hidden_size=H, sglang_num_aux=draft.sglang_num_aux,
                               source="sglang/srt/models/llama_eagle3.py::LlamaModel.__init__"))
        expect = fc_in if fc_in is not None else built
        if served_w != expect:
            out.append(finding("width_mismatch", None,
                               f"the server will feed {served.num_chunks} chunks x {H} = {served_w} but the draft's fc "
                               f"takes {expect}",
                               static=True, served_plan=served.tensors, served_width=served_w, fc_in_features=expect,
                               problems=served.problems, fatal=served.fatal))
    if trained is None or not trained.tensors:
        for p in served.problems:
            out.append(finding(p["kind"], None, p["detail"], static=True, served_plan=served.tensors,
                               rules=served.rules))
        return out
    rows = compare_plans(served, trained)
    ns, nt = served.num_chunks, trained.num_chunks
    ev = {"static": True, "served_plan": served.tensors, "training_plan": trained.tensors,
          "served_ids": None if served.engine_ids is None else str(served.engine_ids),
          "training_ids": None if trained.config_ids is None else str(trained.config_ids),
          "rules": served.rules, "plan_problems": served.problems, "fatal": served.fatal}
    same = [r for r in rows if r["served"] is not None and r["served"] == r["training"]]
    if len(same) == len(rows):
        return out + _unreachable(served, out)
    s_set, t_set = set(served.tensors), set(trained.tensors)
    offsets = [r["offset"] for r in rows[:min(ns, nt)]]
    if min(ns, nt) > 0 and all(o is not None and o == offsets[0] and o != 0 for o in offsets) \
            and EMBEDDING not in s_set:
        for r in rows[:min(ns, nt)]:
            out.append(finding("layer_offset", r["index"],
                               f"the server will feed {r['served']} where training used {r['training']} "
                               f"(offset {offsets[0]:+d} layer)", offset=offsets[0], **ev))
    else:
        moved = {}
        for r in rows:
            s, t = r["served"], r["training"]
            if s is None or s == t:
                continue
            if s == EMBEDDING and EMBEDDING not in t_set:
                if ns > nt and t_set <= s_set:
                    out.append(finding("extra_chunk", r["index"], "the server will feed the embedding output as an "
                                       "extra chunk", **ev))
                else:
                    out.append(finding("embedding_in_place_of_layer", r["index"],
                                       f"the server will feed the embedding output where training used "
                                       f"{t or 'nothing'}", **ev))
            elif s in t_set:
                moved[r["index"]] = trained.tensors.index(s)
            elif t is None:
                out.append(finding("extra_chunk", r["index"], f"the server will feed an extra chunk {s}", **ev))
            else:
                out.append(finding("wrong_layer", r["index"], f"the server will feed {s} where training used {t}"
                                   + (f" (offset {r['offset']:+d})" if r["offset"] is not None else ""),
                                   offset=r["offset"], **ev))
        if moved:
            out.append(finding("chunk_order", None,
                               "chunks reach the draft in another order than in training: "
                               + ", ".join(f"served chunk {i} = training chunk {j}" for i, j in moved.items()),
                               mapping=moved, **ev))
    for j, t in enumerate(trained.tensors):
        if t not in s_set and (j >= ns or served.tensors[j] in t_set):
            out.append(finding("missing_chunk", None, f"training chunk {j} ({t}) is not fed by the server",
                               training_chunk=j, tensor=t, **ev))
    return out + _unreachable(served, out)


def _unreachable(served: CapturePlan, found: list[dict]) -> list[dict]:
    """Served-plan problems not yet reported: an id naming no layer of this target is a finding, never a silently
    dropped chunk."""
    if any(f["kind"] == "missing_chunk" for f in found):
        return []
    return [finding("missing_chunk", None, f"{p['detail']} (config ids {served.config_ids}, capture indices "
                    f"{served.engine_ids})", static=True, served_plan=served.tensors, rules=served.rules,
                    fatal=served.fatal) for p in served.problems if p["kind"] == "missing_chunk"]


# =============================================================================================== numeric

#: how an identity or plan was established, most trusted first (shown in every finding's evidence).
IDENTITY_SOURCES = ("reference", "context-free", "equal chunk", "served plan", "training plan")


@dataclass
class Context:
    """A comparison plus what the detectors need (plans, configs), with the chunk correspondence computed
    once (:attr:`corr`).

    Attributes:
        cmp: the comparison. served_plan / training_plan: capture plans (None if unknown); the training plan
            carries its provenance (``manifest`` / ``inferred`` / ``claimed`` / ``default``).
        draft / weights / target / server: configs when given.
        source: the served source the correspondence is computed on: TP rank 0 (the single source), or the
            ranks' ``gathered`` columns when they hold sharded widths. Chunks on which the ranks disagree are
            explained (or not) by the TP detectors, which look at the ranks' ``sum`` themselves.
    """

    cmp: Comparison
    served_plan: Optional[CapturePlan] = None
    training_plan: Optional[CapturePlan] = None
    draft: Any = None
    weights: Any = None
    target: Any = None
    server: Any = None
    explained: dict = field(default_factory=dict)   # served chunk -> kind that explains it
    notes: list = field(default_factory=list)       # what the data could not settle (one line each)

    @property
    def tol(self) -> float:
        return self.cmp.tolerance

    @cached_property
    def ranks_agree(self) -> bool:
        """All TP ranks fed equal rows (within tolerance) on every chunk."""
        for s in self.cmp.rank_sources[1:]:
            if s.agree is None or s.agree.rows == 0:
                continue
            for i in range(s.num_chunks):
                if not s.agree.metrics(i, i).passed:
                    return False
        return True

    @cached_property
    def source(self) -> SourceResult:
        c = self.cmp
        if c.shard_factor > 1:
            return c.source("gathered") or c.primary
        return c.primary

    def m(self, i: int, j: int, source: Optional[SourceResult] = None) -> PairMetrics:
        return self.cmp.metrics(source or self.source, i, j)

    @cached_property
    def nt(self) -> int:
        return self.cmp.num_training_chunks

    @cached_property
    def ns(self) -> int:
        return self.source.num_chunks

    @property
    def full_width(self) -> bool:
        return self.source.chunk_width == self.cmp.hidden_size

    @cached_property
    def match(self) -> dict[int, int]:
        """served chunk -> the closest training chunk, when they are equal (per-row decision)."""
        if not self.full_width:
            return {}
        out = {}
        for i in range(self.ns):
            j, mt = self.cmp.best_match(self.source, i)
            if mt.passed:
                out[i] = j
        return out

    # -- reservoir rows and fits ------------------------------------------------------------------
    def rows(self, i: int, j: int) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """Reservoir rows (served chunk i, training chunk j), float32 ``[R, H]``; None when unavailable."""
        rv = self.cmp.reservoir
        H = self.cmp.hidden_size
        if rv is None or rv.count < 8 or not self.full_width:
            return None
        return rv.served[:rv.count, i * H:(i + 1) * H], rv.train[:rv.count, j * H:(j + 1) * H]

    @cached_property
    def floor(self) -> dict:
        """The isometry noise floor (:func:`helpers.diagnosis.fit.noise_floor`)."""

        pairs = [r for r in (self.rows(i, j) for i, j in self.match.items()) if r is not None]
        rv = self.cmp.reservoir
        H = self.cmp.hidden_size
        tref = rv.train[:rv.count, :H] if rv is not None and rv.count else torch.zeros(1, H)
        return noise_floor(self.tol, pairs, tref)

    def fit(self, kind: str, i: int, j: int):
        """Cached :class:`helpers.diagnosis.fit.FitResult` of ``kind`` (``isometry`` | ``norm`` | ``scale``) for
        (i, j)."""

        cache = self.__dict__.setdefault("_fits", {})
        key = (kind, i, j)
        if key not in cache:
            r = self.rows(i, j)
            if r is None:
                cache[key] = None
            else:
                cache[key] = (isometry_fit(r[0], r[1], self.floor) if kind == "isometry" else
                              scale_fit(r[0], r[1], self.tol) if kind == "scale" else
                              rms_norm_fit(r[0], r[1], self.tol))
        return cache[key]

    def compared_rows(self, i: int, j: Optional[int] = None) -> int:
        """Rows compared for served chunk ``i`` against training unit ``j`` (default: the most over all units):
        rows finite on both sides, from samples whose tokens agree with training."""
        pairs = self.source.pairs
        if j is not None:
            return int(pairs.n[i, j]) if j < pairs.nu else 0
        return int(pairs.n[i].max()) if pairs.nu else 0

    @cached_property
    def noise(self) -> Optional[dict]:
        """This deployment's measured engine noise: per-row rel_diff quantiles of the chunk pairs found equal."""
        if not self.match:
            return None
        ms = [self.m(i, j) for i, j in self.match.items()]
        p50 = max(m.row_rel_diff.get("p50") or 0 for m in ms)
        p90 = max(m.row_rel_diff.get("p90") or 0 for m in ms)
        return {"row_rel_diff_p50": p50, "row_rel_diff_p90": p90, "pairs": len(ms),
                "margin_to_tolerance": None if not p90 else float(f"{self.tol / p90:.3g}")}

    # -- identities ----------------------------------------------------------------------------------
    def served_identity(self, i: int) -> tuple[Optional[str], Optional[str]]:
        """(tensor name, how it was identified) for served chunk ``i`` of :attr:`source`."""
        ident = self.cmp.identify(self.source.ref, i)
        if ident and ident["passed"]:
            return ident["best"], "reference"
        cf = self.source.stats.context_free(i, self.tol)
        if cf and self.source.stats.zero[i] == 0:
            return EMBEDDING, "context-free rows (equal rows for equal token ids at different positions)"
        plan = self.served_plan
        if plan is not None and plan.num_chunks == self.ns and not self._plan_contradicted_served:
            return plan.tensors[i], f"served plan ({plan.source or plan.who})"
        return None, None

    @cached_property
    def _plan_contradicted_served(self) -> bool:
        # the served plan is wrong if a chunk it calls "embedding" is not context-free, or vice versa, or if
        # the reference identifies a chunk as another tensor
        plan = self.served_plan
        if plan is None or plan.num_chunks != self.ns:
            return True
        for i, t in enumerate(plan.tensors):
            cf = self.source.stats.context_free(i, self.tol)
            if cf is not None and cf != (t == EMBEDDING):
                return True
            ident = self.cmp.identify(self.source.ref, i)
            if ident and ident["passed"] and ident["best"] != t:
                return True
        return False

    @cached_property
    def training_identity(self) -> list[tuple[Optional[str], Optional[str]]]:
        """(tensor name, how) per training chunk: reference > a served chunk it equals > training plan
        (shifted by the offset the equalities imply when they contradict the plan)."""
        res: list[tuple[Optional[str], Optional[str]]] = [(None, None)] * self.nt
        for j in range(self.nt):
            ident = self.cmp.identify(self.cmp.training_ref, j)
            if ident and ident["passed"]:
                res[j] = (ident["best"], "reference")
        derived = {}
        for i, j in self.match.items():
            if res[j][0] is None:
                name, how = self.served_identity(i)
                if name is not None:
                    derived[j] = (name, f"equal chunk: equals served chunk {i} ({how})")
        plan = self.training_plan
        shift = None
        if plan is not None and plan.num_chunks == self.nt and derived:
            offs = {layer_of(derived[j][0]) - layer_of(plan.tensors[j]) for j in derived
                    if derived[j][0] not in (None, FINAL_NORM) and plan.tensors[j] != FINAL_NORM}
            if len(offs) == 1:
                shift = offs.pop()
        for j in range(self.nt):
            if res[j][0] is not None:
                continue
            if j in derived:
                res[j] = derived[j]
            elif plan is not None and plan.num_chunks == self.nt:
                t = plan.tensors[j]
                if shift and t != FINAL_NORM and layer_of(t) is not None:
                    L = layer_of(t) + shift
                    res[j] = (EMBEDDING if L == -1 else f"out({L})",
                              f"training plan ({plan.provenance}: {plan.source or plan.who}) {plan.tensors[j]} shifted "
                              f"by {shift:+d} (implied by equal chunks)")
                else:
                    res[j] = (t, f"training plan ({plan.provenance}: {plan.source or plan.who})")
        return res

    @cached_property
    def corr(self) -> dict:
        """Chunk correspondence: which served chunk stands for which training chunk and why."""
        ns, nt = self.ns, self.nt
        s_id = [self.served_identity(i) for i in range(ns)]
        t_id = self.training_identity
        match = {i: j for i, j in self.match.items() if i not in self.explained}
        unmatched_s = [i for i in range(ns) if i not in match and i not in self.explained]
        matched_t = set(match.values()) | {j for i, j in self.explained.items() if isinstance(j, int)}
        # consistent layer shift: no chunk sits at its own index and every position has the same offset
        offsets = []
        for i in range(min(ns, nt)):
            a, b = s_id[i][0], t_id[i][0]
            la = layer_of(a) if a not in (None, FINAL_NORM) else None
            lb = layer_of(b) if b not in (None, FINAL_NORM) else None
            offsets.append(None if la is None or lb is None else la - lb)
        positional = [i for i in range(min(ns, nt)) if i not in self.explained]
        shift = None
        if positional and all(match.get(i) != i for i in positional):
            offs = {offsets[i] for i in positional}
            if len(offs) == 1 and None not in offs and 0 not in offs and \
                    all(s_id[i][0] != EMBEDDING for i in positional):
                shift = offs.pop()
        return {"s_id": s_id, "t_id": t_id, "match": match, "unmatched_s": unmatched_s, "matched_t": matched_t,
                "offsets": offsets, "shift": shift, "positional": positional}

    def candidates(self, i: int, top: int = 3) -> list[dict]:
        """The closest training chunks to served chunk ``i`` (and reference layers when given), ranked."""
        out = []
        if self.full_width:
            for j, mt in self.cmp.ranked(self.source, i)[:top]:
                out.append({"training_chunk": j, "training_identified_as": self.corr_t(j),
                            "share_within": float(f"{mt.share_within:.4g}"),
                            "row_rel_diff_p50": mt.row_rel_diff.get("p50"),
                            "row_cosine_p50": None if mt.median_cosine is None else float(f"{mt.median_cosine:.6g}")})
        return out

    def corr_t(self, j: int) -> Optional[str]:
        return self.training_identity[j][0] if j < self.nt else None

    def ev(self, i: Optional[int] = None, j: Optional[int] = None) -> dict:
        """Common evidence for served chunk i / training chunk j, with the provenance of both identities."""
        e: dict = {"source": self.source.name, "tolerance": self.tol}
        prov: dict = {}
        if i is not None:
            sid = self.corr["s_id"][i]
            e["served_identified_as"] = sid[0]
            e["served_identified_by"] = sid[1]
            prov["served"] = sid[1] or "not identified (no reference, not context-free, no served plan)"
            ident = self.cmp.identify(self.source.ref, i)
            if ident:
                e["served_reference_match"] = ident
            if self.full_width:
                e["closest_training_chunks"] = self.candidates(i)
                e["outlier_rows"] = self.source.stats.outliers(i)
        if j is not None and j < self.nt:
            tid = self.corr["t_id"][j]
            e["training_chunk"] = j
            e["training_identified_as"] = tid[0]
            e["training_identified_by"] = tid[1]
            prov["training"] = tid[1] or "not identified (no reference, no training plan)"
            if i is not None and self.full_width:
                e["metrics"] = self.m(i, j)
        if prov:
            e["provenance"] = prov
        return e


# ------------------------------------------------------------------------------------ per-kind detectors

def detect_nan_or_inf(ctx: Context) -> list[dict]:
    """``nan_or_inf``: served (per rank) or training rows holding NaN/Inf. A non-finite chunk row is left out of
    that chunk's pairs only (the other chunks of the row are compared); a chunk left with no comparable row is
    said to be unsettled, never named a layer (:func:`detect_not_comparable`)."""
    out = []
    for src in ctx.cmp.rank_sources:
        for i in range(src.num_chunks):
            n = src.stats.nonfinite[i]
            if n:
                left = src.stats.rows - n
                what = (f"{n} of {src.stats.rows} served rows of chunk {i} hold NaN/Inf"
                        + (f" on TP rank {src.tp_rank}" if src.tp_rank is not None else ""))
                if left == 0:
                    what += (": no row of this chunk can be compared, so which tensor it holds is not settled "
                             "(the other chunks are compared on their own rows)")
                else:
                    what += f" (left out of this chunk's comparison; {left} finite rows compared)"
                out.append(finding("nan_or_inf", i, what, side="served", source=src.name, tp_rank=src.tp_rank,
                                   rows=n, rows_total=src.stats.rows, finite_rows=left,
                                   first=src.stats.nonfinite_at[i]))
    ts = ctx.cmp.training_stats
    for j in range(ts.n):
        if ts.nonfinite[j]:
            left = ts.rows - ts.nonfinite[j]
            out.append(finding("nan_or_inf", None,
                               f"{ts.nonfinite[j]} of {ts.rows} training rows of chunk {j} hold NaN/Inf"
                               + (f": no row of training chunk {j} can be compared" if left == 0 else
                                  f" (left out of comparisons with training chunk {j}; {left} finite rows)"),
                               side="training", training_chunk=j, rows=ts.nonfinite[j], rows_total=ts.rows,
                               finite_rows=left, first=ts.nonfinite_at[j]))
    return out


def detect_token_mismatch(ctx: Context) -> list[dict]:
    """``token_mismatch``: a served sample's prompt ids differ from its training sample's, or served samples match
    no training sample (unless the training data were read only up to ``max_samples``: then the served samples
    beyond are not compared and a note says so). The rows of such a sample (before the first difference) may not be aligned with the
    training rows (the file may hold another sample's rows): they are compared apart (the sources' ``suspect``
    accumulators, reported here) and never used to name a layer; when no other row was compared, the finding
    says that which tensor each chunk holds is not settled."""
    a = ctx.cmp.alignment
    out = []
    if a["token_mismatches"]:
        tm = a["token_mismatches"]
        f0 = tm[0]
        n_sus = a.get("rows_in_mismatched_samples", 0)
        clean = a["rows_compared"] - n_sus
        sus = ctx.source.suspect
        on_sus = {}
        if sus is not None and sus.rows and ctx.full_width:
            for i in range(min(ctx.ns, ctx.nt)):
                m = sus.metrics(i, i, ctx.tol)
                on_sus[str(i)] = {"rows": m.rows, "share_within_tolerance": float(f"{m.share_within:.4g}"),
                                  "row_cosine_p50": None if m.median_cosine is None else float(f"{m.median_cosine:.6g}")}
        detail = (f"{len(tm)} served sample(s) differ from their training sample inside the prompt; first: "
                  f"{f0['served_sample']} position {f0['position']} id {f0['served_token_id']} vs training "
                  f"{f0['training_sample']} id {f0['training_token_id']}")
        if n_sus:
            agree = ", ".join(f"chunk {i} {v['share_within_tolerance']:.0%}" for i, v in on_sus.items())
            detail += (f". Their {n_sus} rows before the difference are kept out of the layer comparison (a sample "
                       "whose prompt differs may hold rows that are not aligned with the training rows)"
                       + (f"; on them, rows within tolerance of the same training chunk: {agree}" if agree else ""))
        if clean == 0:
            detail += (". No row of a sample whose tokens agree was compared, so which tensor each chunk holds is "
                       "not settled: layer findings are withheld. Capture the served states for the training "
                       "prompts (the same token ids, in the same samples) to settle it")
        elif ctx.full_width and all(ctx.match.get(i) == i for i in range(ctx.ns)) and ctx.ns == ctx.nt:
            detail += f". The {clean} rows of the samples whose tokens agree match training chunk for chunk"
        out.append(finding("token_mismatch", None, detail, mismatches=tm[:10], count=len(tm),
                           rows_in_mismatched_samples=n_sus, rows_compared_for_layers=clean,
                           mismatched_rows_vs_same_training_chunk=on_sus))
    if a["unpaired_served"] and a.get("training_truncated"):
        # the training data were read only up to max_samples: the served samples beyond are not compared, which says
        # nothing about their tokens
        ctx.notes.append(f"{len(a['unpaired_served'])} served sample(s) were not compared: max_samples stopped "
                         f"reading the training data after {a['training_samples_seen']} sample(s)")
    elif a["unpaired_served"]:
        out.append(finding("token_mismatch", None,
                           f"{len(a['unpaired_served'])} served sample(s) match no training sample by input_ids",
                           unpaired=a["unpaired_served"][:10], count=len(a["unpaired_served"])))
    return out


def detect_tp_sharded_width(ctx: Context) -> list[dict]:
    """``tp_sharded_width``: each rank holds ``H/k`` columns per chunk (a capture taken on a TP-sharded
    tensor): the served width is the training width / k, and rank r's chunk i equals columns
    ``[r*H/k, (r+1)*H/k)`` of a training chunk."""
    c = ctx.cmp
    if c.shard_factor == 1:
        return []
    k = c.shard_factor
    slices = {}
    for src in c.rank_sources:
        for i in range(src.num_chunks):
            u, mt = c.best_match(src, i)
            slices[f"{src.name}/chunk{i}"] = {"training_unit": c.training_units[u], "rel_diff": mt.rel_diff,
                                             "passed": mt.passed}
    ev = {"served_width": c.served_width, "training_width": c.training_width, "chunk_width": c.chunk_width,
          "hidden_size": c.hidden_size, "shard_factor": k, "ranks": [s.tp_rank for s in c.rank_sources],
          "slices": slices}
    g = c.source("gathered")
    if g is not None:
        ev["gathered"] = {f"chunk{i}": c.metrics(g, i, i).to_json() for i in range(g.num_chunks)}
    return [finding("tp_sharded_width", None,
                    f"served width {c.served_width} = training width {c.training_width} / {k}: each TP rank holds "
                    f"{c.chunk_width} of {c.hidden_size} columns per chunk (captured before the gather)", **ev)]


def detect_tp_partial_sum(ctx: Context) -> list[dict]:
    """``tp_partial_sum``: ranks disagree on a chunk, no rank matches training, but the sum over ranks does
    (each rank captured its un-reduced share, SGLang comparator dims ``h[tp:partial]``)."""
    c = ctx.cmp
    ssum = c.source("sum")
    ranks = c.rank_sources
    if ssum is None or len(ranks) < 2 or ctx.ranks_agree:
        return []
    out = []
    for i in range(ssum.num_chunks):
        if i in ctx.explained:
            continue
        disagree = {s.name: s.agree.metrics(i, i, c.tolerance).rel_diff for s in ranks[1:] if s.agree is not None}
        if all(v <= c.tolerance for v in disagree.values()):
            continue
        j, mt = c.best_match(ssum, i)
        if not mt.passed:
            continue
        per_rank = {s.name: c.metrics(s, i, j).rel_diff for s in ranks}
        per_rank_share = {s.name: c.metrics(s, i, j).share_within for s in ranks}
        # one rank may come close when the layer's update is small next to the residual it adds to (a deep
        # target's middle layers); the ranks still feed their drafts different tensors, and only the sum is right
        if all(v >= MATCH_SHARE for v in per_rank_share.values()):
            continue
        ctx.explained[i] = j
        out.append(finding("tp_partial_sum", i,
                           f"chunk {i} differs across the {len(ranks)} TP ranks and matches no training chunk on any "
                           f"rank, but the sum over ranks equals training chunk {j} (rel_diff {mt.rel_diff:.2e}): "
                           "the capture took un-reduced partial sums",
                           training_chunk=j, sum_metrics=mt, per_rank_rel_diff=per_rank,
                           per_rank_share_within=per_rank_share, rank_vs_rank0_rel_diff=disagree,
                           tp_size=len(ranks)))
    return out


def _vocab_shard(vocab: int, rank: int, tp: int) -> tuple[int, int]:
    """Vocab ids held by ``rank``: padded to 64 (x tp when needed), split evenly
    (``sglang/srt/layers/vocab_parallel_embedding.py``, ``pad_vocab_size``)."""
    pad = 64
    if ((vocab + pad - 1) // pad * pad) % tp:
        pad *= tp
    padded = (vocab + pad - 1) // pad * pad
    per = padded // tp
    return rank * per, min(vocab, (rank + 1) * per)


def detect_embedding_not_all_reduced(ctx: Context) -> list[dict]:
    """``embedding_not_all_reduced``: a chunk's rows are exactly zero for the token ids outside one contiguous
    id range and equal for equal ids inside it: a vocab-parallel embedding captured on one rank before its
    all-reduce (``VocabParallelEmbedding._embed_local_shard`` zeroes out-of-shard rows,
    ``sglang/srt/layers/vocab_parallel_embedding.py``)."""
    c = ctx.cmp
    vocab = ctx.target.vocab_size if ctx.target is not None else None
    out = []
    by_chunk: dict[int, list] = {}
    for src in c.rank_sources:
        st = src.stats
        for i in range(src.num_chunks):
            if st.zero[i] == 0 or st.nonzero_min[i] is None:
                continue
            lo, hi = st.nonzero_min[i], st.nonzero_max[i]
            if any(lo <= z <= hi for z in st.zero_ids[i]):
                continue
            if st.context_free(i, c.tolerance) is False:
                continue
            ev = {"tp_rank": src.tp_rank, "zero_rows": st.zero[i], "rows": st.rows, "nonzero_id_range": [lo, hi],
                  "zero_row_ids_sample": sorted(st.zero_ids[i])[:10],
                  "repeated_token_max_rel_diff": st.ctx_max[i]}
            tp = src.tp_size or (len(c.rank_sources) if len(c.rank_sources) > 1 else None)
            if vocab and tp and src.tp_rank is not None:
                a, b = _vocab_shard(vocab, src.tp_rank, tp)
                ev["expected_shard"] = [a, b - 1]
                ev["consistent_with_shard"] = a <= lo and hi <= b - 1
            by_chunk.setdefault(i, []).append(ev)
    ssum = c.source("sum")
    for i, evs in by_chunk.items():
        extra = {}
        if ssum is not None and i < ssum.num_chunks:
            extra["sum_over_ranks_context_free"] = ssum.stats.context_free(i, c.tolerance)
            ident = c.identify(ssum.ref, i)
            if ident:
                extra["sum_over_ranks_reference_match"] = ident
            if ssum.chunk_width == c.hidden_size:
                j, mt = c.best_match(ssum, i)
                extra["sum_over_ranks_best_training_chunk"] = {"chunk": j, "rel_diff": mt.rel_diff,
                                                               "passed": mt.passed}
                if mt.passed:
                    ctx.explained[i] = j
        else:
            ctx.explained[i] = "embedding_not_all_reduced"
        out.append(finding("embedding_not_all_reduced", i,
                           f"chunk {i} is an embedding captured before its TP all-reduce: rows are zero exactly for "
                           f"token ids outside one vocab shard ({len(evs)} rank(s) seen)",
                           ranks=evs, **extra))
        ctx.explained.setdefault(i, "embedding_not_all_reduced")
    return out


def detect_width_mismatch(ctx: Context) -> list[dict]:
    """``width_mismatch``: served width != training width (not explained by TP sharding or a bypassed fc)."""
    c = ctx.cmp
    if c.shard_factor > 1 or "fc_bypassed" in ctx.explained.values():
        return []
    if c.served_width == c.training_width:
        return []
    return [finding("width_mismatch", None,
                    f"served rows are {c.served_width} wide ({c.served_width // c.hidden_size} chunks of {c.hidden_size}) "
                    f"but training rows are {c.training_width} wide ({c.num_training_chunks} chunks)",
                    served_width=c.served_width, training_width=c.training_width, hidden_size=c.hidden_size,
                    served_plan=None if ctx.served_plan is None else ctx.served_plan.tensors,
                    training_plan=None if ctx.training_plan is None else ctx.training_plan.tensors)]


def _fit_target(ctx: Context, i: int, kind: str):
    """(training chunk, fit) of the first candidate (same index first, then the closest) whose ``kind``
    transform fits served chunk ``i``; (None, None) if none does."""
    if not ctx.full_width:
        return None, None
    order = ([i] if i < ctx.nt else []) + [j for j, _ in ctx.cmp.ranked(ctx.source, i) if j != i]
    for j in order:
        f = ctx.fit(kind, i, j)
        if f is not None and f.fits:
            return j, f
    return None, None


def _reference_layer(ctx: Context, i: int) -> Optional[str]:
    ident = ctx.cmp.identify(ctx.source.ref, i)
    return ident["best"] if ident and ident["passed"] else None


def _fitted_chunks(ctx: Context, transform: str):
    """Yield ``(served chunk i, training chunk j, fit)`` for each unmatched, unexplained served chunk that no
    reference layer identifies and that ``transform`` (``isometry`` / ``norm`` / ``scale``) maps from a training
    chunk; marks ``i`` explained by ``j``. The one loop of the transform-fitted detectors."""
    for i in ctx.corr["unmatched_s"]:
        if i in ctx.explained or _reference_layer(ctx, i) is not None:
            continue
        j, f = _fit_target(ctx, i, transform)
        if j is None:
            continue
        ctx.explained[i] = j
        yield i, j, f


def detect_rotated_basis(ctx: Context) -> list[dict]:
    """``rotated_basis``: an orthogonal map takes a training chunk to the served chunk at the noise floor
    (per-row norms and pairwise angles preserved: :func:`helpers.diagnosis.fit.isometry_fit`), while the rows
    themselves point elsewhere (median row cosine <= 0.9: a rotation-based quantisation applied on one side).
    Never named for a chunk the reference identifies as a layer."""
    out = []
    for i, j, f in _fitted_chunks(ctx, "isometry"):
        st = f.stats
        out.append(finding("rotated_basis", i,
                           f"served chunk {i} is training chunk {j} in another basis: an orthogonal map fits at the "
                           f"noise floor (row norms within {st['norm_dev_p90']:.2g}, pairwise angles within "
                           f"{st['angle_dev_p90']:.2g} at the 90th percentile; floor {f.floor['norm']:.2g}) while the "
                           f"rows' median cosine is {st['row_cosine_p50']:.3f}",
                           fit=f.to_json(), **ctx.ev(i, j)))
    return out


def detect_norm_mismatch(ctx: Context) -> list[dict]:
    """``norm_mismatch``: an RMS norm with a per-dim weight, applied on one side only, maps a training chunk
    to the served chunk (fitted on half of the reservoir rows, >= 90 % of the other half within tolerance:
    :func:`helpers.diagnosis.fit.rms_norm_fit`), e.g. a final norm / ``norm_before_fc`` / ``fc_norm`` moved."""
    out = []
    for i, j, f in _fitted_chunks(ctx, "norm"):
        side = "served chunk = RMS norm of training chunk" if f.transform == "rms_norm" else \
            "training chunk = RMS norm of served chunk"
        out.append(finding("norm_mismatch", i,
                           f"served chunk {i} is training chunk {j} through an RMS norm applied on one side ({side}, "
                           f"per-dim weight fitted): {f.stats['share_within']:.0%} of held-out rows within tolerance",
                           fit=f.to_json(), **ctx.ev(i, j)))
    return out


def detect_not_comparable(ctx: Context) -> list[dict]:
    """No finding, a note: a served chunk with no comparable row against its training chunk (every row of one
    side non-finite, or only rows of samples whose tokens differ) is not settled, and no layer finding may be
    built on it. The ``nan_or_inf`` / ``token_mismatch`` finding says why."""
    a = ctx.cmp.alignment
    clean = a["rows_compared"] - a.get("rows_in_mismatched_samples", 0)
    for i in range(ctx.ns):
        if i in ctx.explained or i in ctx.match:
            continue
        if ctx.compared_rows(i, i if i < ctx.nt and ctx.full_width else None) > 0:
            continue
        st = ctx.source.stats
        why = []
        if clean == 0:
            why.append("every aligned row comes from a sample whose prompt ids differ from training")
        if st.nonfinite[i] and st.nonfinite[i] == st.rows:
            why.append(f"all {st.rows} served rows of this chunk hold NaN/Inf")
        ts = ctx.cmp.training_stats
        if i < ts.n and ts.nonfinite[i] and ts.nonfinite[i] == ts.rows:
            why.append(f"all {ts.rows} rows of training chunk {i} hold NaN/Inf")
        ctx.explained[i] = "not_comparable"
        reason = "; ".join(why) or "no row finite on both sides"
        ctx.notes.append(f"chunk {i}: inconclusive, no comparable rows ({reason}): which tensor it holds is not "
                         "settled; a capture with finite rows for the training prompts would settle it")
    return []


def detect_zero_chunk(ctx: Context) -> list[dict]:
    """``zero_chunk``: a served chunk is exactly zero on (nearly) every finite row while the training chunk is not:
    the capture delivers zeros there (a hook that never fired, a buffer never written or cleared), not a layer
    output. A rank-local embedding (zero rows outside one vocab shard) is ``embedding_not_all_reduced``."""
    out = []
    st = ctx.source.stats
    ts = ctx.cmp.training_stats
    for i in range(ctx.ns):
        if i in ctx.explained or i in ctx.match:
            continue
        finite = st.rows - st.nonfinite[i]
        if finite <= 0 or st.zero[i] < MATCH_SHARE * finite:
            continue
        j = i if i < ctx.nt else None
        tz = None if j is None else ts.zero[j]
        if j is not None and tz >= MATCH_SHARE * max(1, ts.rows - ts.nonfinite[j]):
            continue                    # training is zero too: not this fault
        ctx.explained[i] = "zero_chunk"
        ev = ctx.ev(i, j)
        ev.update(zero_rows=st.zero[i], finite_rows=finite, rows=st.rows, training_zero_rows=tz,
                  training_rows=ts.rows)
        out.append(finding("zero_chunk", i,
                           f"served chunk {i} is exactly zero on {st.zero[i]} of its {finite} finite rows"
                           + (f" while training chunk {j} is zero on {tz} of {ts.rows}" if j is not None else "")
                           + ": the capture delivers zeros here (a hook that never fired, a buffer never written or "
                           "cleared), not a layer output", **ev))
    return out


def detect_scaled_chunk(ctx: Context) -> list[dict]:
    """``scaled_chunk``: the served chunk is a training chunk times one constant: rows point the same way and
    their norm ratio is constant, and scaling by the fitted factor brings >= ``MATCH_SHARE`` of held-out rows
    within tolerance (:func:`helpers.diagnosis.fit.scale_fit`). Never named for a chunk the reference identifies
    as a layer."""
    out = []
    for i, j, f in _fitted_chunks(ctx, "scale"):
        st = f.stats
        mt = ctx.m(i, j)
        mean_f = None if mt.mean_log_norm_ratio is None else math.exp(mt.mean_log_norm_ratio)
        spread = mt.std_log_norm_ratio
        out.append(finding("scaled_chunk", i,
                           f"served chunk {i} is training chunk {j} times {st['factor']:.4g}: the rows point "
                           f"{'the same way' if st['factor'] > 0 else 'the opposite way'} (median row cosine "
                           f"{st['row_cosine_p50']:.5f}) with a constant norm ratio (per-row "
                           f"factor {st['row_factor_p10']:.4g} to {st['row_factor_p90']:.4g} at the 10th / 90th "
                           f"percentile; over all {mt.rows} rows the norm ratio runs {mt.row_norm_ratio_min:.4g} to "
                           f"{mt.row_norm_ratio_max:.4g}, geometric mean {mean_f:.4g}, log spread {spread:.2g}); scaled "
                           f"back, {st['share_within']:.0%} of held-out rows are within tolerance (unscaled "
                           f"{st['share_within_unscaled']:.0%}). Something multiplies one side by a constant; it is "
                           "not another layer",
                           factor=st["factor"], norm_ratio_geomean=mean_f, log_norm_ratio_std=spread,
                           fit=f.to_json(), **ctx.ev(i, j)))
    return out


#: a served chunk equal to one training chunk on at least this share of its rows (but < MATCH_SHARE) is that
#: chunk with a minority of rows altered: another layer of a deep target differs on the ordinary rows too
#: (row cosine <= 0.99: rel_diff above the tolerance), so it agrees on few rows (the massive-activation rows).
PARTIAL_SHARE = 0.5


def _sampled_pair(ctx: Context, i: int, j: int) -> Optional[tuple[torch.Tensor, torch.Tensor, np.ndarray]]:
    """The reservoir rows of (served i, training j) in float64 without the rows zero on both sides, and the keep
    mask (numpy bool over the reservoir); None when fewer than 8 rows are left. Shared by the partial-match
    evidence (:func:`_differing_rows`, :func:`_dims_partial`)."""
    r = ctx.rows(i, j)
    if r is None:
        return None
    S, T = r[0].double(), r[1].double()
    keep = (S.square().sum(-1) + T.square().sum(-1)) > 0
    if int(keep.sum()) < 8:
        return None
    return S[keep], T[keep], keep.numpy()


def _differing_rows(ctx: Context, i: int, j: int) -> Optional[dict]:
    """What sets the reservoir rows of (served i, training j) outside the tolerance apart: their energy against
    the median row, where they sit (positions / token ids) and the dims that hold their difference."""
    got = _sampled_pair(ctx, i, j)
    if got is None:
        return None
    S, T, keep = got
    rv = ctx.cmp.reservoir
    ids, pos = rv.ids[:rv.count][keep], rv.positions[:rv.count][keep]
    d2 = (S - T).square()
    rel = d2.sum(-1) / (S.square().sum(-1) + T.square().sum(-1))
    bad = (rel > ctx.tol).numpy()
    if not bad.any():
        return None
    e = T.square().sum(-1)
    med = float(e.median())
    be = e[torch.from_numpy(bad)]
    per_dim = d2[torch.from_numpy(bad)].sum(0)
    tot = float(per_dim.sum())
    v, dims = torch.topk(per_dim, min(3, per_dim.numel()))
    top_rank = torch.argsort(e, descending=True)[:int(bad.sum())]
    top_set = set(top_rank.tolist())
    bad_idx = np.nonzero(bad)[0]
    return {"reservoir_rows": int(S.shape[0]), "differing_rows": int(bad.sum()),
            "energy_vs_median_row_p50": float(f"{float(be.median()) / med:.4g}") if med > 0 else None,
            "share_among_highest_energy_rows": float(f"{len(top_set & set(bad_idx.tolist())) / bad.sum():.4g}"),
            "positions": [int(x) for x in pos[bad_idx[:8]]], "token_ids": [int(x) for x in ids[bad_idx[:8]]],
            "diff_dims": [int(x) for x in dims], "diff_dims_share": float(f"{float(v.sum()) / tot:.4g}") if tot else None}


#: at most this many dims may be left out for a dim-wise partial match (massive-activation / outlier dims).
PARTIAL_MAX_DIMS = 4


def _dims_partial(ctx: Context, i: int, j: int) -> Optional[dict]:
    """Reservoir test: leaving out the k <= :data:`PARTIAL_MAX_DIMS` dims that hold most of the difference, are
    >= ``MATCH_SHARE`` of the rows of (served i, training j) within tolerance? (Another layer differs across
    the whole width: a few dims never explain it.) Returns the dims and shares, or None."""
    got = _sampled_pair(ctx, i, j)
    if got is None:
        return None
    S, T, _ = got
    d2 = (S - T).square()
    # the rest of each row against the whole row's energy: engine noise scales with the row (a massive row's
    # noise would swamp its small remainder), and the left-out dims only leave the numerator
    e2 = (S.square() + T.square()).sum(-1).clamp_min(1e-300)
    per_dim = d2.sum(0)
    order = torch.argsort(per_dim, descending=True)
    tot = float(per_dim.sum())
    for k in range(1, min(PARTIAL_MAX_DIMS, S.shape[1] - 1) + 1):
        mask = torch.ones(S.shape[1], dtype=torch.bool)
        mask[order[:k]] = False
        rel = d2[:, mask].sum(-1) / e2
        share = float((rel <= ctx.tol).double().mean())
        if share >= MATCH_SHARE:
            return {"dims": [int(x) for x in order[:k]], "share_within_without_dims": float(f"{share:.4g}"),
                    "dims_share_of_difference": float(f"{float(per_dim[order[:k]].sum()) / tot:.4g}") if tot else None,
                    "reservoir_rows": int(S.shape[0])}
    return None


def detect_partial_match(ctx: Context) -> list[dict]:
    """``partial_match``: a served chunk equals one training chunk on most of its rows (>= :data:`PARTIAL_SHARE`,
    < ``MATCH_SHARE``): the same tensor with a minority of rows altered (the evidence says which rows: energy,
    positions, token ids, and the dims holding the difference); or on >= ``MATCH_SHARE`` of the rows once at
    most :data:`PARTIAL_MAX_DIMS` dims are left out (:func:`_dims_partial`): a few dims altered. Not another
    layer (another layer of a deep target differs on the ordinary rows, across the width). Never named for a
    chunk the reference identifies as a layer."""
    out = []
    if not ctx.full_width:
        return out
    for i in ctx.corr["unmatched_s"]:
        if i in ctx.explained or _reference_layer(ctx, i) is not None:
            continue
        j, mt = ctx.cmp.best_match(ctx.source, i)
        if mt.rows == 0 or mt.share_within >= MATCH_SHARE:
            continue
        cos = "n/a" if mt.median_cosine is None else f"{mt.median_cosine:.4f}"
        if mt.share_within < PARTIAL_SHARE:
            dp = _dims_partial(ctx, i, j)
            if dp is None:
                continue
            ctx.explained[i] = "partial_match"
            ev = ctx.ev(i, j)
            ev["differing_dims"] = dp
            out.append(finding("partial_match", i,
                               f"served chunk {i} equals training chunk {j} except on dims {dp['dims']}: leaving them "
                               f"out, {dp['share_within_without_dims']:.0%} of the sampled rows are within tolerance "
                               f"(with them {mt.share_within:.0%} of {mt.rows} rows; median row cosine {cos}), and "
                               f"they hold {dp['dims_share_of_difference']:.0%} of the difference. The same tensor "
                               "with a few dims altered (often the massive-activation dims), not another layer "
                               "(another layer differs across the whole width); what alters them is not settled "
                               "by the data", **ev))
            continue
        ctx.explained[i] = "partial_match"
        within = int(round(mt.share_within * mt.rows))
        ev = ctx.ev(i, j)
        rows = _differing_rows(ctx, i, j)
        ev["differing_rows"] = rows
        ev["rows_within"] = within
        what = ""
        if rows:
            hi = rows["share_among_highest_energy_rows"]
            what = (f"; in the reservoir sample the {rows['differing_rows']} differing rows have a median energy "
                    f"{rows['energy_vs_median_row_p50']:.3g} x the median row's"
                    + (" (they are the highest-energy rows: massive activations)" if hi >= 0.8 and
                       (rows["energy_vs_median_row_p50"] or 0) > 10 else "")
                    + f", positions {rows['positions']}, token ids {rows['token_ids']}, and dims "
                    f"{rows['diff_dims']} hold {rows['diff_dims_share']:.0%} of their difference")
        out.append(finding("partial_match", i,
                           f"served chunk {i} equals training chunk {j} on {mt.share_within:.0%} of the rows ({within} "
                           f"of {mt.rows} within tolerance; median per-row rel_diff "
                           f"{(mt.row_rel_diff.get('p50') or 0):.2g}, median row cosine {cos}) but not on the other "
                           f"{mt.rows - within}{what}. The same tensor with a minority of rows altered, not another "
                           "layer (another layer differs on the ordinary rows too); what alters those rows (clamping "
                           "or overflow of large values, another path for some tokens) is not settled by the data",
                           **ev))
    return out


def _shift_applies(ctx: Context) -> bool:
    cr = ctx.corr
    return cr["shift"] is not None and all(i not in ctx.explained for i in cr["positional"])


def detect_layer_offset(ctx: Context) -> list[dict]:
    """``layer_offset``: every served chunk is the training chunk's layer shifted by the same k (typically +1:
    SGLang's +1 applied to ids that already mean capture points). Identities come from ``--reference``, from
    chunks found equal, or from the capture plans (each finding says which)."""
    if not _shift_applies(ctx):
        return []
    cr = ctx.corr
    k = cr["shift"]
    out = []
    plan_only = all(not (cr["s_id"][i][1] or "").startswith(("reference", "context-free")) and
                    not (cr["t_id"][i][1] or "").startswith(("reference", "equal chunk")) for i in cr["positional"])
    for i in cr["positional"]:
        ev = ctx.ev(i, i)
        if plan_only:
            ev["note"] = ("both identities come from the capture plans (configs + rules); the data only show that "
                          "no chunk equals its training chunk. An every-layer reference (capture --every-layer, or HF) "
                          "would identify the served layers directly")
        out.append(finding("layer_offset", i,
                           f"served chunk {i} is {cr['s_id'][i][0]} where training has {cr['t_id'][i][0]} "
                           f"(every chunk {abs(k)} layer{'s' if abs(k) > 1 else ''} {'late' if k > 0 else 'early'})",
                           offset=k, **ev))
        ctx.explained[i] = f"layer_offset {k:+d}"
    return out


def _is_extra(ctx: Context, i: int) -> bool:
    cr = ctx.corr
    return ctx.ns > ctx.nt and (i >= ctx.nt or len(cr["matched_t"]) >= ctx.nt)


def detect_embedding_in_place_of_layer(ctx: Context) -> list[dict]:
    """``embedding_in_place_of_layer``: a served chunk is the embedding output (context-free: equal rows for
    equal token ids; or identified by ``--reference``) where training had a decoder layer's output."""
    out = []
    cr = ctx.corr
    for i in cr["unmatched_s"]:
        if i in ctx.explained or cr["s_id"][i][0] != EMBEDDING or _is_extra(ctx, i):
            continue
        j = i if i < ctx.nt else None
        ev = ctx.ev(i, j)
        ev["repeated_token_pairs"] = ctx.source.stats.ctx_pairs[i]
        ev["repeated_token_max_rel_diff"] = ctx.source.stats.ctx_max[i]
        tj = [ctx.cmp.training_stats.context_free(t, ctx.tol) for t in range(ctx.nt)]
        ev["training_chunks_context_free"] = tj
        ctx.explained[i] = "embedding"
        out.append(finding("embedding_in_place_of_layer", i,
                           f"served chunk {i} is the embedding output (rows depend only on the token id) where training "
                           f"had {cr['t_id'][i][0] if j is not None and cr['t_id'][i][0] else 'a layer output'}",
                           **ev))
    return out


def detect_chunk_order(ctx: Context) -> list[dict]:
    """``chunk_order``: served chunks equal training chunks at other positions (permuted or shifted
    concatenation, e.g. unsorted ids: SGLang concatenates in ascending layer order)."""
    if _shift_applies(ctx):
        return []
    moved = {i: j for i, j in ctx.corr["match"].items() if i != j and i not in ctx.explained}
    if not moved:
        return []
    for i in moved:
        ctx.explained[i] = moved[i]
    perm = sorted(moved) == sorted(moved.values())
    return [finding("chunk_order", None,
                    ("chunks are permuted: " if perm else "chunks are shifted: ")
                    + ", ".join(f"served chunk {i} = training chunk {j}" for i, j in sorted(moved.items())),
                    mapping={str(i): j for i, j in sorted(moved.items())}, permutation=perm,
                    metrics={str(i): ctx.m(i, j) for i, j in sorted(moved.items())}, source=ctx.source.name)]


def detect_extra_chunk(ctx: Context) -> list[dict]:
    """``extra_chunk``: more served chunks than training chunks, and this one matches no training chunk."""
    out = []
    for i in ctx.corr["unmatched_s"]:
        if i in ctx.explained or not _is_extra(ctx, i):
            continue
        ctx.explained[i] = "extra"
        out.append(finding("extra_chunk", i, f"served chunk {i} ({ctx.corr['s_id'][i][0] or 'unidentified'}) has no "
                           f"counterpart in training ({ctx.ns} served vs {ctx.nt} training chunks)", **ctx.ev(i)))
    return out


def detect_wrong_layer(ctx: Context) -> list[dict]:
    """``wrong_layer``: a served chunk matches no training chunk and no more specific fault fits (offset,
    embedding, rotation, norm, TP): the server feeds another tensor at that position. The finding ranks the
    closest candidates (training chunks, reference layers) and says where each identity comes from; when the
    plans call both sides the same tensor it says that the data contradict the plans instead of stating it."""
    out = []
    cr = ctx.corr
    for i in cr["unmatched_s"]:
        if i in ctx.explained or i >= ctx.nt:
            continue
        off = cr["offsets"][i] if i < len(cr["offsets"]) else None
        (sname, sby), (tname, tby) = cr["s_id"][i], cr["t_id"][i]
        ctx.explained[i] = "wrong_layer"
        ev = ctx.ev(i, i)
        mt = ctx.m(i, i) if ctx.full_width else None
        data = (f"{mt.share_within:.0%} of {mt.rows} rows within tolerance, median per-row rel_diff "
                f"{(mt.row_rel_diff.get('p50') or 0):.2g}, median row cosine "
                + ("n/a (a zero row)" if mt.median_cosine is None else f"{mt.median_cosine:.3f}")) \
            if mt else "different widths"
        cands = ev.get("closest_training_chunks", [])
        ref = ev.get("served_reference_match")
        if sname is not None and sname == tname:
            detail = (f"served chunk {i} is not training chunk {i} ({data}), although the {_short(sby)} and the "
                      f"{_short(tby)} both call it {sname}: one of them is wrong")
            if ctx.training_plan is not None and ctx.training_plan.provenance == "claimed":
                detail += ("; the training side is only what the draft config claims (no training manifest), and "
                           "a config edited after training gives exactly this")
        else:
            what = f" ({sname}, {_short(sby)})" if sname else ""
            twhat = f" ({tname}, {_short(tby)})" if tname else ""
            detail = f"served chunk {i}{what} is not training chunk {i}{twhat}: {data}"
            if off:
                detail += f"; by those identities: offset {off:+d} layer(s)"
        if ref and not ref["passed"]:
            # no layer of the target equals the chunk on >= MATCH_SHARE of the rows (as a layer would: the reference
            # comes from the same engine): not "another layer", something transforms the chunk
            near = ", ".join(f"{c['tensor']} ({c['share_within']:.0%} rows within tolerance)"
                             for c in ref["candidates"][:3])
            ctx.explained[i] = "unidentified_chunk"
            out.append(finding(
                "unidentified_chunk", i,
                f"served chunk {i} is not training chunk {i} ({data}) and matches no layer of the target for the "
                f"same tokens (closest reference layers: {near}): it is not a layer output; something between the "
                "residual stream and the capture transforms it (a per-rank partial value, a mix of tensors, a "
                "quantization error beyond tolerance). Per-rank capture (TP ranks compared) or the capture code "
                "settles what", offset=off, **ev))
            continue
        elif not ref and cands:
            detail += ("; closest training chunks: " + ", ".join(
                f"{c['training_chunk']} (median row cosine "
                f"{'n/a' if c['row_cosine_p50'] is None else c['row_cosine_p50']})" for c in cands[:2])
                       + "; to name the layer, compare with an every-layer reference (capture --every-layer, or HF)")
        out.append(finding("wrong_layer", i, detail, offset=off, **ev))
    return out


def _short(how: Optional[str]) -> str:
    """'served plan (...)' -> 'served plan'; 'reference' -> 'reference'."""
    if not how:
        return "unknown source"
    return how.split(" (")[0]


def detect_missing_chunk(ctx: Context) -> list[dict]:
    """``missing_chunk``: a training chunk that no served chunk equals and no served chunk stands in for
    (position beyond the served width, or taken by a chunk that moved)."""
    out = []
    cr = ctx.corr
    matched_t = set(cr["match"].values()) | {j for j in ctx.explained.values() if isinstance(j, int)}
    for j in range(ctx.nt):
        if j in matched_t:
            continue
        why = ctx.explained.get(j)
        if j < ctx.ns and ((j not in cr["match"] and not isinstance(why, int))
                           or (isinstance(why, str) and why.startswith("layer_offset"))):
            continue  # the served chunk at this position stands in for it (wrong layer, offset, ...)
        tid = cr["t_id"][j]
        ev = {"training_chunk": j, "training_identified_as": tid[0], "training_identified_by": tid[1],
              "served_chunks": ctx.ns, "training_chunks": ctx.nt, "source": ctx.source.name}
        if ctx.served_plan is not None and ctx.served_plan.problems:
            ev["served_plan_problems"] = ctx.served_plan.problems
        out.append(finding("missing_chunk", None,
                           f"training chunk {j} ({tid[0] or 'unidentified'}) is not fed by the server", **ev))
    return out


NUMERIC_DETECTORS = (
    detect_nan_or_inf, detect_token_mismatch, detect_tp_sharded_width, detect_embedding_not_all_reduced,
    detect_tp_partial_sum, detect_width_mismatch, detect_not_comparable, detect_zero_chunk,
    detect_embedding_in_place_of_layer, detect_rotated_basis, detect_norm_mismatch, detect_scaled_chunk,
    detect_partial_match, detect_layer_offset, detect_chunk_order, detect_extra_chunk, detect_wrong_layer,
    detect_missing_chunk,
)


def _withhold_unaligned(ctx: Context, out: list[dict]) -> list[dict]:
    """Kinds marked ``aligned`` in :mod:`helpers.kinds` are built on the served rows compared with the training
    rows of the same tokens (served-side facts: non-finite or zero rows, context-free rows, widths, do not depend
    on the alignment). When served samples differ from their training samples inside the prompt, the file's rows are not known
    to be aligned with the training rows (samples reordered, another data set, rows of one sample under another
    sample's ids): findings built on the row comparison are withheld and listed in the token_mismatch finding,
    which says what would settle them."""
    tm = next((f for f in out if f["kind"] == "token_mismatch" and "mismatches" in f["evidence"]), None)
    if tm is None:
        return out
    held = [f for f in out if f["kind"] in ALIGNED_KINDS]
    if not held:
        return out
    tm["evidence"]["withheld_findings"] = [{"kind": f["kind"], "chunk": f["chunk"], "detail": f["detail"]}
                                           for f in held]
    what = ", ".join(f"{f['kind']}" + ("" if f["chunk"] is None else f" (chunk {f['chunk']})") for f in held)
    tm["detail"] += (f". The rows of the other samples do not match training either ({what}), but with prompts "
                     "that differ elsewhere in this file their rows are not known to be aligned: those findings are "
                     "withheld (evidence.withheld_findings). Capture the served states for the training prompts "
                     "(the same token ids, in the same samples) to settle which tensor each chunk holds")
    return [f for f in out if f["kind"] not in ALIGNED_KINDS]


def run_numeric(ctx: Context) -> list[dict]:
    """All numeric detectors in dependency order (specific explanations first, ``wrong_layer`` and
    ``missing_chunk`` last). fc_bypassed short-circuits the layer detectors. Findings built on the row
    comparison are withheld when the served prompts differ from training (:func:`_withhold_unaligned`)."""
    out: list[dict] = []
    numeric_fc = detect_fc_bypassed(ctx.draft, ctx.server, ctx, ctx.weights)
    for det in NUMERIC_DETECTORS:
        if numeric_fc and det not in (detect_nan_or_inf, detect_token_mismatch):
            continue
        out.extend(det(ctx))
    return _withhold_unaligned(ctx, out) + numeric_fc
