"""The acceptance budget: where the accept length goes, from the training log to the live server.

Stages (each an accept length with a 95 % CI, bootstrap over sequences; losses paired where the sequences are the
same):

1. ``training log``: what the training run claims (marginal per-position accuracy, bonus token added, cut at the
   server's steps: :func:`helpers.draft.training_log.predicted_accept_length`).
2. ``offline, training states``: the draft checkpoint run offline on the training data's aux states
   (:mod:`helpers.draft.simulate`). The **draft** loss is the log minus this, both through the same marginal
   formula (like with like: a checkpoint that does worse on its own training states than its log says is damaged,
   mis-exported, or has a wrong vocab map).
3. ``offline, served states``: the same draft on the aux states the server feeds for the same training tokens. The
   **wiring** loss is stage 2 minus stage 3, paired per sequence.
4. ``offline, served states (live prompts)`` and ``live``: the same ``/generate`` answers give the served aux states
   of the server's own greedy continuation and the server's accept counters; the **engine** loss (after the capture
   point: the draft computed differently inside the engine, positions, KV reuse) is the simulation minus live,
   paired per request.
5. ``best settings``: the simulation on the live prompts' served states at other ``steps`` (chain), each scored by
   ``accept_length / (1 + steps x r)`` with ``r`` one draft forward's cost relative to a verify step (from the
   weights each reads: a decode step at small batch is bound by the bytes it reads); the **settings** loss is the
   recommended settings' accept length minus the served settings', counted when the modelled gain is material.

The cause is the stage whose loss is beyond its CI and material (>= ``MATERIAL`` of the expected accept length and
>= ``MIN_TOKENS`` tokens); the largest such loss wins; ``none`` when none is; ``unknown`` when no stage counts, a stage
could not be computed, and live acceptance is materially below the training log's prediction (what is missing is listed).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np
import pandas as pd
import torch

from ..acceptance.stats import paired_effect
from ..errors import BadInput
from ..formats.configs import read_target_config
from ..formats.dumps import read_dump
from ..formats.training_data import TrainingData
from ..runfiles import jsonable
from .model import Eagle3Draft
from .simulate import DraftSettings, SimSequence, simulate_sequences, summary

#: a loss is material when it is at least this share of the expected accept length ...
MATERIAL = 0.08
#: ... and at least this many tokens per verify step
MIN_TOKENS = 0.1
#: chain steps tried for the settings stage
SETTINGS_STEPS = (1, 2, 3, 4, 5, 6, 7, 8)
#: the recommended steps: the fewest whose accept length is within this share of the best
NEAR_BEST = 0.05
CAUSES = ("none", "draft", "wiring", "engine", "settings", "workload", "unknown")
#: ablation findings that are evidence for a cause (helpers.investigation.ablate)
ABLATION_CAUSES = {"engine_feature_costs_acceptance": "engine", "concurrency_loses_acceptance": "engine",
                   "context_loses_acceptance": "workload", "temperature_loses_acceptance": "workload"}


# ------------------------------------------------------------------------------------------------ sequences

def _start_from_mask(mask: Any, n: int) -> int:
    if mask is None:
        return 1
    m = np.asarray(mask).reshape(-1)[:n]
    nz = np.nonzero(m > 0)[0]
    return int(nz[0]) if len(nz) else n


def training_sequences(td: TrainingData, *, lm_head: Optional[torch.Tensor] = None,
                       skipped: Optional[list] = None) -> list[SimSequence]:
    """The training data's samples as sequences: aux rows as recorded, the continuation from the first loss-masked
    token; when the sample records the target's final (post-norm) hidden state and ``lm_head [V, H]`` is given, the
    target's own greedy token at each position (else the recorded tokens are taken as the target's).

    A sample with no continuation to draft on (fewer than 3 tokens, an all-zero ``loss_mask``, a mask starting on
    the last two tokens) is left out, as it adds nothing to a trainer's loss either; ``skipped`` (when given)
    receives ``(file, why)`` for each.

    Raises:
        BadInput: a sample's aux hidden states hold NaN / Inf (the file and key named), or no sample is usable (the
            first file named).
    """
    out, left = [], []
    for s in td:
        ids = torch.as_tensor(np.asarray(s.input_ids), dtype=torch.long)
        where = (s.meta or {}).get("path") or str(s.sample_id or s.key)
        mask = (s.meta or {}).get("loss_mask")
        start = max(1, _start_from_mask(mask, len(ids)))
        if start > len(ids) - 2:
            all_zero = mask is not None and not (np.asarray(mask).reshape(-1) > 0).any()
            why, fld = ((f"{len(ids)} token(s), expected at least 3", "input_ids") if len(ids) < 3 else
                        ("loss_mask is all zero", "loss_mask") if all_zero else
                        (f"the loss mask starts at token {start} of {len(ids)}: expected a prompt token and at "
                         "least 2 loss-masked tokens", "loss_mask"))
            left.append((where, why, fld))
            continue
        aux = s.load()
        if not bool(torch.isfinite(aux).all()):
            raise BadInput(f"{int((~torch.isfinite(aux)).sum())} NaN / Inf values in the aux hidden states "
                           "(expected finite)", path=where, field=str((s.meta or {}).get("aux_key") or
                                                                       "aux_hidden_state"))
        targets = None
        final = (s.meta or {}).get("final_hidden")
        if final is not None and lm_head is not None:
            logits = final.float() @ lm_head.float().T
            targets = ids.clone()
            targets[1:] = logits[:-1].argmax(-1)
        out.append(SimSequence(str(s.sample_id or s.key), ids, aux, start, targets))
    if skipped is not None:
        skipped.extend((w, why) for w, why, _ in left)
    if left and not out:
        w, why, fld = left[0]
        raise BadInput(f"no sample has a continuation to draft on ({len(left)} sample(s); this one: {why})",
                       path=w, field=fld)
    return out


def dump_sequences(path, *, starts: Optional[dict[str, int]] = None) -> list[SimSequence]:
    """A project dump's samples as sequences. Row t of a served dump is position t of ``input_ids`` followed by
    ``output_ids[:-1]``; the continuation starts at ``num_prompt_tokens`` (a capture with a greedy continuation) or
    at ``starts[sample_id]`` (the training tokens replayed with ``max_new_tokens=1``; with ``starts``, samples whose id
    is not in it are left out).

    Raises:
        BadInput: ``starts`` is given and no sample id of the dump is in it (the manifest named)."""
    src = read_dump(path)
    out = []
    if starts is not None:
        ids = [str(s.sample_id or s.key) for s in src.samples]
        if not set(ids) & set(starts):
            raise BadInput(f"none of the dump's sample ids ({', '.join(ids[:4])}{' ...' if len(ids) > 4 else ''}) "
                           f"is a training sample ({', '.join(list(starts)[:4])}{' ...' if len(starts) > 4 else ''}"
                           "): expected a capture of the same training tokens", path=Path(path) / "manifest.json",
                           field="sample_id")
    for s in src.samples:
        if starts is not None and str(s.sample_id or s.key) not in starts:
            continue                        # not one of these training samples: nothing to pair it with
        ids = np.asarray(s.input_ids).reshape(-1)
        outs = np.asarray(s.output_ids).reshape(-1) if s.output_ids is not None else np.zeros(0, dtype=np.int64)
        sid = str(s.sample_id or s.key)
        if starts is not None and sid in starts:
            tokens, start = ids, starts[sid]
        else:
            tokens = np.concatenate([ids[: s.num_prompt_tokens or len(ids)], outs]) if len(outs) else ids
            start = int(s.num_prompt_tokens or len(ids))
        if s.first_position:
            continue                        # a cached / chunked prefix: the rows do not start at position 0
        out.append(SimSequence(sid, torch.as_tensor(tokens, dtype=torch.long), s.load(), start))
    return out


def plan_sequences(reference_path, plan: Sequence[str], like: Sequence[SimSequence]) -> list[SimSequence]:
    """Sequences whose aux states are the every-layer reference's tensors ``plan`` (e.g. ``["out(1)", "out(3)",
    "out(4)"]``: the served plan a proposed fix yields), on the tokens of ``like`` (matched by sample id)."""
    src = read_dump(reference_path)
    names = list((src.layer_plan or {}).get("tensors") or [])
    H = src.hidden_size or (src.width // max(1, len(names)))
    idx = []
    for t in plan:
        if t not in names:
            raise KeyError(f"the reference dump holds no {t!r} (it has {', '.join(names[:6])}, ...)")
        idx.append(names.index(t))
    by_id = {str(s.sample_id or s.key): s for s in src.samples}
    out = []
    for seq in like:
        s = by_id.get(seq.key)
        if s is None:
            continue
        rows = s.load()
        n = min(rows.shape[0], int(seq.tokens.shape[0]))
        aux = torch.cat([rows[:n, i * H:(i + 1) * H] for i in idx], dim=-1)
        out.append(SimSequence(seq.key, seq.tokens[:n], aux, seq.start, None if seq.targets is None
                               else seq.targets[:n]))
    return [s for s in out if s.start <= int(s.tokens.shape[0]) - 2]


def _weight_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.glob("*.safetensors"))


def draft_cost(draft_dir: Path, target_dir: Path, *, draft_cost: Optional[float] = None) -> tuple[float, str]:
    """One draft forward's cost relative to one verify step, and where the figure comes from.

    At the small batches where speculative decoding pays, a forward is bound by the weight bytes it reads: the ratio
    of the draft's safetensors bytes to the target's (a mixture-of-experts target reads only its active experts per
    token, so the ratio is then an underestimate of the draft's share). Without the target's weights here, the
    target's parameters are estimated from its config (12 x hidden^2 x layers + vocab x hidden)."""
    if draft_cost is not None:
        return float(draft_cost), "given"
    d = _weight_bytes(draft_dir)
    t = _weight_bytes(target_dir)
    if d and t:
        return d / t, f"weight bytes: draft {d / 2**20:.1f} MiB / target {t / 2**20:.1f} MiB"
    tc = read_target_config(target_dir)
    vocab = int(tc.raw.get("vocab_size") or 0)
    params = 12 * tc.hidden_size ** 2 * tc.num_hidden_layers + vocab * tc.hidden_size
    if d and params:
        return d / (2 * params), "draft weight bytes / target parameters estimated from its config (bf16)"
    return 0.1, "unknown (no weights here): 0.1 assumed"


# ------------------------------------------------------------------------------------------------ statistics

def _formula(marginal: Sequence[float], steps: int) -> float:
    """1 + sum_k prod_{j<=k} a_j over the first ``steps`` marginal accuracies (the training frameworks' estimate)."""
    total, prod = 1.0, 1.0
    for a in list(marginal)[:steps]:
        prod *= a
        total += prod
    return total


def _marginal_ci(per_seq_hits: np.ndarray, per_seq_rows: np.ndarray, steps: int, *, n_boot: int = 2000,
                 seed: int = 0) -> tuple[float, float, float]:
    """The marginal-formula accept length with a bootstrap CI over sequences."""
    hits, rows = per_seq_hits[:, :steps], per_seq_rows[:, :steps]
    point = _formula(hits.sum(0) / np.maximum(rows.sum(0), 1), steps)
    if len(hits) < 2:
        return point, float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    vals = []
    for _ in range(n_boot):
        i = rng.integers(0, len(hits), len(hits))
        vals.append(_formula(hits[i].sum(0) / np.maximum(rows[i].sum(0), 1), steps))
    lo, hi = np.percentile(vals, [2.5, 97.5])
    return point, float(lo), float(hi)


def _stage(name: str, per_request: Optional[pd.DataFrame], steps: int, *, source: str, **extra) -> dict:
    st: dict[str, Any] = {"name": name, "source": source}
    if per_request is not None and len(per_request):
        s = summary(per_request, steps)
        st.update(accept_length=s["accept_length"], ci=[s["accept_length_lo"], s["accept_length_hi"]],
                  accept_rate=s["accept_rate"], accept_rate_ci=[s["accept_rate_lo"], s["accept_rate_hi"]],
                  p_accept_ge=s["p_accept_ge"], verify_steps=s["verify_steps"], sequences=int(s["n_spec"] or 0))
    st.update(extra)
    return st


def _loss(name: str, delta: float, lo: float, hi: float, basis: str, expected: float, **extra) -> dict:
    material = bool(np.isfinite(delta) and delta >= max(MIN_TOKENS, MATERIAL * expected))
    beyond = bool(np.isfinite(lo) and lo > 0)
    return {"stage": name, "delta": delta, "ci": [lo, hi], "basis": basis, "beyond_ci": beyond,
            "material": material, "counts": material and beyond, **extra}


def _paired_loss(a: pd.DataFrame, b: pd.DataFrame) -> tuple[float, float, float, int]:
    """accept length of ``a`` minus ``b``, paired per request id (``paired_effect`` gives b - a)."""
    e = paired_effect(a, b)
    return (-e["accept_length_delta"], -e["accept_length_delta_hi"], -e["accept_length_delta_lo"], e["n_paired"])


@dataclass
class BudgetInputs:
    """What the budget is computed from (any may be None: its stage is then missing, with ``missing`` saying why).

    Attributes:
        settings: the served ``(steps, topk, draft_tokens)``.
        log: ``predicted_accept_length(...)`` of the training log at the served steps, or None.
        training: sequences from the training data (:func:`training_sequences`).
        served_training: the served aux states for the same training tokens (:func:`dump_sequences` with starts).
        live_sequences: the served aux states of the live prompts with the server's own continuation.
        live: the live per-request frame of the same answers.
        max_new_tokens: the live requests' max_new_tokens.
        fix: ``{"label", "sequences", "plan", "draft"?}``: the proposed fix applied offline: the served plan it yields
            taken from the every-layer reference, and/or the draft it yields (a corrected d2t), or None.
        draft_cost / draft_cost_source: one draft forward's cost relative to one verify step (the settings stage
            picks the steps that maximise ``accept_length / (1 + steps x draft_cost)``) and where it comes from.
    """

    settings: DraftSettings
    log: Optional[dict] = None
    training: Optional[list[SimSequence]] = None
    served_training: Optional[list[SimSequence]] = None
    live_sequences: Optional[list[SimSequence]] = None
    live: Optional[pd.DataFrame] = None
    max_new_tokens: Optional[int] = None
    fix: Optional[dict] = None
    draft_cost: Optional[float] = None
    draft_cost_source: str = "not given"


def acceptance_budget(draft: Eagle3Draft, inp: BudgetInputs, *, progress=None) -> dict:
    """Compute the budget (see the module docstring).

    Returns ``{"settings", "stages": [{name, accept_length, ci, ...}], "losses": {draft|wiring|engine|settings:
    {delta, ci, beyond_ci, material, counts, basis}}, "cause", "sentence", "recommended_settings", "fix_offline",
    "missing": [...], "draft_sources"}`` (accept lengths in tokens per verify step, bonus token included).
    """
    st = inp.settings.check()
    S = st.steps
    stages: list[dict] = []
    losses: dict[str, dict] = {}
    missing: list[str] = []
    notes: list[str] = []
    expected = None

    def sim(seqs, settings, mnt=None):
        return simulate_sequences(draft, seqs, settings, max_new_tokens=mnt, progress=progress)

    # 1 -- training log
    if inp.log is not None:
        stages.append({"name": "training log", "accept_length": inp.log["accept_length"], "ci": [None, None],
                       "p_accept_ge": inp.log.get("p_accept_ge"), "kind": inp.log.get("kind"),
                       "source": inp.log.get("source", "training log"), "note": inp.log.get("note", "")})
    else:
        missing.append("training log: none found (give --training-log; the draft stage needs it)")

    # 2 -- offline on training states
    train_frame = None
    if inp.training:
        r = sim(inp.training, [st])
        train_frame = r["per_request"][st]
        hits = np.array([m for m in r["marginal_hits"]], dtype=float)
        rows = np.array([m for m in r["marginal_rows_per_seq"]], dtype=float)
        fpt, flo, fhi = _marginal_ci(hits, rows, S)
        stages.append(_stage("offline, training states", train_frame, S,
                             source=f"the draft run offline on {len(inp.training)} training sample(s)",
                             marginal=r["marginal"][:S], marginal_formula=fpt, marginal_formula_ci=[flo, fhi],
                             greedy_share=r["greedy_share"]))
        expected = stages[-1].get("accept_length")
        if inp.log is not None:
            d = inp.log["accept_length"] - fpt
            losses["draft"] = _loss("draft", d, inp.log["accept_length"] - fhi, inp.log["accept_length"] - flo,
                                    "training log vs the checkpoint's marginal accuracy on its training states "
                                    "(both 1 + sum of products of marginal accuracies)", inp.log["accept_length"])
    else:
        missing.append("offline on training states: no training samples")

    # 3 -- offline on served states, same training tokens
    served_frame = None
    if inp.served_training and train_frame is not None:
        r = sim(inp.served_training, [st])
        f = served_frame = r["per_request"][st]
        stages.append(_stage("offline, served states", f, S,
                             source=f"the draft run offline on the aux states the server fed for the same "
                                    f"{len(inp.served_training)} training sample(s)"))
        d, lo, hi, n = _paired_loss(train_frame, f)
        losses["wiring"] = _loss("wiring", d, lo, hi, f"training states vs served states, paired over {n} "
                                 "sample(s)", expected or 0.0)
    elif inp.served_training is None:
        missing.append("offline on served states: no served capture of the training tokens")

    # 4 -- live prompts: offline on their served states vs live
    live_sim = None
    if inp.live_sequences and inp.live is not None:
        r = sim(inp.live_sequences, [st], inp.max_new_tokens)
        live_sim = r["per_request"][st]
        stages.append(_stage("offline, served states (live prompts)", live_sim, S,
                             source=f"the draft run offline on the aux states of {len(inp.live_sequences)} live "
                                    "request(s), the server's own greedy continuation"))
        stages.append(_stage("live", inp.live, S, source="the same /generate answers' spec_verify_ct and "
                                                         "spec_num_correct_drafts (SGLang's counters)"))
        d, lo, hi, n = _paired_loss(live_sim, inp.live)
        losses["engine"] = _loss("engine", d, lo, hi, f"offline on served states vs live, paired over {n} "
                                 "request(s) (same prompts, same tokens)", expected or stages[-2]["accept_length"])
    else:
        missing.append("live: no live requests with served states")

    # 5 -- settings
    rec = None
    grid_src = inp.live_sequences or inp.served_training or inp.training
    grid_name = ("live prompts' served states" if grid_src is inp.live_sequences else
                 "served states" if grid_src is inp.served_training else "training states")
    if grid_src:
        grid = sorted({DraftSettings.chain(s) for s in SETTINGS_STEPS} | {st}, key=lambda x: (x.topk, x.steps))
        r = sim(grid_src, grid, inp.max_new_tokens if grid_src is inp.live_sequences else None)
        table = []
        for g in grid:
            s = summary(r["per_request"][g], g.steps)
            table.append({"steps": g.steps, "topk": g.topk, "draft_tokens": g.draft_tokens,
                          "accept_length": s["accept_length"], "ci": [s["accept_length_lo"], s["accept_length_hi"]],
                          "frame": r["per_request"][g]})
        r_cost = inp.draft_cost if inp.draft_cost is not None else 0.0
        for t in table:
            t["speedup_model"] = t["accept_length"] / (1.0 + t["steps"] * r_cost)
        # the stage is about acceptance: fewer steps than served accept less; the cost model's view of them is a note
        chains = [t for t in table if t["topk"] == 1 and t["steps"] >= st.steps] or [t for t in table
                                                                                    if t["topk"] == 1]
        rec = max(chains, key=lambda t: t["speedup_model"])
        fewer = max((t for t in table if t["topk"] == 1 and t["steps"] < st.steps), default=None,
                    key=lambda t: t["speedup_model"])
        served = next(t for t in table if (t["steps"], t["topk"], t["draft_tokens"]) ==
                      (st.steps, st.topk, st.draft_tokens))
        d, lo, hi, n = _paired_loss(rec["frame"], served["frame"])
        gain = rec["speedup_model"] / served["speedup_model"] - 1.0 if served["speedup_model"] else 0.0
        if fewer is not None and served["speedup_model"] and \
                fewer["speedup_model"] / served["speedup_model"] - 1.0 >= MATERIAL and inp.draft_cost is not None:
            notes.append(f"the cost model favours --speculative-num-steps {fewer['steps']} (fewer than served: "
                           f"accept length {fewer['accept_length']:.2f}, modelled tokens per unit time "
                           f"{fewer['speedup_model'] / served['speedup_model'] - 1.0:+.0%}); measure it before "
                           "changing")
        if inp.draft_cost is None:
            # without a cost for a draft step, more steps always look better: no settings are recommended
            missing.append("settings: no draft-step cost (draft_cost); the table is shown, nothing is recommended")
            rec, gain = served, 0.0
        if (rec["steps"], rec["topk"]) == (st.steps, st.topk) or gain < MATERIAL:
            d, lo, hi = 0.0, 0.0, 0.0
        stages.append({"name": "best settings (simulated)", "accept_length": rec["accept_length"], "ci": rec["ci"],
                       "settings": {k: rec[k] for k in ("steps", "topk", "draft_tokens")},
                       "source": f"the draft run offline on the {grid_name} at other --speculative-num-steps; "
                                 f"chosen by accept length / (1 + steps x {r_cost:.3f}), the draft forward's cost "
                                 f"relative to a verify step ({inp.draft_cost_source})",
                       "modelled_speedup_gain": gain})
        losses["settings"] = _loss("settings", d, lo, hi, f"recommended vs served settings, simulated on the same "
                                   f"{n} sequence(s); modelled tokens per unit time {gain:+.0%}",
                                   served["accept_length"])
        for t in table:
            t.pop("frame")
        settings_table = table
    else:
        settings_table = []

    # the fix, proven offline
    fix_offline = None
    if inp.fix and inp.fix.get("sequences"):
        fdraft = inp.fix.get("draft") or draft
        r = simulate_sequences(fdraft, inp.fix["sequences"], [st])
        f = r["per_request"][st]
        s = summary(f, S)
        fix_offline = {"label": inp.fix.get("label", "proposed fix"), "accept_length": s["accept_length"],
                       "ci": [s["accept_length_lo"], s["accept_length_hi"]], "plan": inp.fix.get("plan")}
        if inp.served_training:
            if served_frame is None:                 # stage 3 did not run (no training frame): simulate them here
                served_frame = simulate_sequences(draft, inp.served_training, [st])["per_request"][st]
            d, lo, hi, n = _paired_loss(f, served_frame)  # paired on the sample ids both hold
            fix_offline.update(gain=d, gain_ci=[lo, hi], n_paired=n,
                               proven=bool(np.isfinite(lo) and lo > 0 and d >= MIN_TOKENS))

    cause = _cause(losses, inp.log["accept_length"] if inp.log else expected, inp.live, missing)
    workload = None
    names = {x["name"]: x.get("accept_length") for x in stages}
    tr, lp = names.get("offline, training states"), names.get("offline, served states (live prompts)")
    if tr is not None and lp is not None:
        workload = {"training_samples": tr, "live_prompts": lp, "delta": tr - lp,
                    "note": "the same draft, offline, on the training samples vs on the live prompts: a difference "
                            "in workload (how predictable the text is), not a fault"}
    out = {"settings": {"steps": st.steps, "topk": st.topk, "draft_tokens": st.draft_tokens},
           "stages": stages, "losses": losses, "cause": cause, "missing": missing, "notes": notes,
           "recommended_settings": None if rec is None else {k: rec[k] for k in ("steps", "topk", "draft_tokens")},
           "settings_table": settings_table, "fix_offline": fix_offline, "draft_sources": draft.sources,
           "workload": workload}
    out["sentence"] = budget_sentence(out)
    return jsonable(out)


def _cause(losses: dict, reference_al: Optional[float], live: Optional[pd.DataFrame], missing: list[str]) -> str:
    """The counted loss that is largest; ``unknown`` when none counts, a stage could not be computed and live
    acceptance is materially below ``reference_al`` (the training log's, else the offline one on training states);
    else ``none``. With every stage computed and none counting, a gap between training and live prompts is the
    workload (reported, not a cause)."""
    counted = {k: v for k, v in losses.items() if v.get("counts")}
    if counted:
        return max(counted, key=lambda k: counted[k]["delta"])
    if missing and reference_al is not None and live is not None and len(live):
        ok = live[live["verify_ct"].fillna(0) > 0]
        if len(ok):
            gap = reference_al - float(ok["completion_tokens"].sum() / ok["verify_ct"].sum())
            if gap >= max(MIN_TOKENS, MATERIAL * reference_al):
                return "unknown"
    return "none"


def join_ablation(b: dict, findings: Sequence[dict]) -> dict:
    """Put the evidence of ablations and workload sweeps (findings of :mod:`helpers.investigation.ablate`) into the
    budget ``b`` and return it: each becomes ``b["ablation"][cause]`` evidence. When the budget found a loss no stage
    explains (cause ``unknown``), an engine toggle that recovers acceptance makes the cause ``engine`` and a workload
    sweep whose acceptance falls makes it ``workload`` (the requests, not the server), with the measured paired change
    as its loss (tokens per verify step, bonus token included) and the sentence rewritten. With cause ``none`` (the
    measured prompts lose nothing) the cause stays: a note says which requests would lose acceptance (e.g. longer
    contexts than the prompts measured), not that the server's loss comes from them; an explained cause stays too."""
    ev: dict[str, list] = {}
    for f in findings:
        c = ABLATION_CAUSES.get(f["kind"])
        if c is not None:
            ev.setdefault(c, []).append(f)
    if not ev:
        return b
    b["ablation"] = {c: [{"kind": f["kind"], "detail": f["detail"]} for f in fs] for c, fs in ev.items()}
    if b.get("cause") == "none":
        b.setdefault("notes", []).append(
            "no loss on the prompts measured here; " + "; ".join(f"{f['kind']}: {f['detail']}" for fs in ev.values()
                                                             for f in fs)
            + " (a cause of low acceptance where production requests are like these, not of a loss measured here)")
        return jsonable(b)
    if b.get("cause") != "unknown":
        return b
    cause = "engine" if "engine" in ev else "workload"
    f = ev[cause][0]
    e = f["evidence"]
    if f["kind"] == "engine_feature_costs_acceptance":
        eff = e.get("effect") or {}
        d, ci = eff.get("accept_length_delta"), [eff.get("accept_length_delta_lo"), eff.get("accept_length_delta_hi")]
    else:
        t = e.get("trend") or {}
        d = None if t.get("delta") is None else -t["delta"]
        ci = [None if x is None else -x for x in reversed(t.get("ci") or [None, None])]
    b.setdefault("losses", {})[cause] = {"delta": d, "ci": ci, "beyond_ci": True, "material": True, "counts": True,
                                         "basis": f"measured on the server ({f['kind']}): {f['detail']}"}
    b["cause"] = cause
    b["sentence"] = budget_sentence(b)
    return jsonable(b)


def _fmt(x: Optional[float]) -> str:
    return "n/a" if x is None or not np.isfinite(x) else f"{x:.2f}"


def budget_sentence(b: dict) -> str:
    """One sentence: where the accept length goes (each stage's accept length) and the cause."""
    parts = [f"{s['name']} {_fmt(s.get('accept_length'))}" for s in b["stages"]]
    cause = b["cause"]
    L = b["losses"]
    if cause == "none":
        why = "no stage loses a material share beyond its CI"
        w = b.get("workload")
        if w and w["delta"] >= MIN_TOKENS:
            why += (f"; the live prompts are less predictable for this draft than its training samples "
                    f"({w['live_prompts']:.2f} vs {w['training_samples']:.2f} offline): workload, not a fault")
    elif cause == "unknown":
        why = ("live acceptance is materially below the training log's prediction and no stage that could be "
               "computed explains it; missing: " + "; ".join(b["missing"]))
    else:
        l = L[cause]
        why = f"{l['delta']:.2f} tokens per verify step lost at the {cause} stage [{_fmt(l['ci'][0])}, " \
              f"{_fmt(l['ci'][1])}] ({l['basis']})"
        if cause == "settings" and b.get("recommended_settings"):
            r = b["recommended_settings"]
            why += f"; recommended --speculative-num-steps {r['steps']} --speculative-eagle-topk {r['topk']} " \
                   f"--speculative-num-draft-tokens {r['draft_tokens']}"
    return f"Accept length by stage: {', '.join(parts)}. Cause: {cause}: {why}."
