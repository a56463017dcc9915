"""The offline side of the fault matrix: a generated fault (:mod:`support.faultgen`) run through the acceptance
budget with no server, and its true loss measured beside it.

Sequences: the bundled live prompts continued greedily by the target (HF transformers, float32), with every layer
of the target recorded for them (:func:`helpers.capture.capture_reference_hf`): the trained plan's tensors are the
"training states", a fault's served plan (SGLang's rules for shifted ids, or a chunk permutation) are the "served
states", exactly as the server would feed them for those tokens. The same greedy sequences stand for the live
prompts (the engine stage); an engine fault is emulated by running the drafting chain for "live" with a draft whose
``fc`` / ``hidden_norm`` outputs are perturbed as ``helpers.hooks.perturb_factory`` perturbs them inside SGLang.

The draft stage runs the (damaged) checkpoint teacher-forced on the validation rows of the log's kind
(``env/models/data/validation``), as the live tool does; the clean checkpoint's pass is computed once.

The TRUE loss of a draw (``loss``, with its CI ``loss_ci``): the drafting chain on the greedy sequences, the clean
server (clean draft, trained plan, steps 3 chain) minus the faulty one (its draft, served plan, settings, and for an
engine fault the perturbed draft), paired per sequence (:func:`helpers.acceptance.stats.paired_effect`), in tokens
per verify step; measured on all ``truth_prompts`` sequences (64: a 16-prompt estimate of a loss near 0.2 has a CI
of +-0.15), while the budget sees the first ``prompts`` of them (16, as ``investigate`` sends).
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from helpers.acceptance.prompts import Prompt, load_prompts
from helpers.acceptance.stats import paired_effect
from helpers.draft.budget import BudgetInputs, acceptance_budget, draft_cost, plan_sequences
from helpers.draft.draft_stage import budget_fields, draft_rows
from helpers.draft.model import Eagle3Draft, _rms, compute_threads
from helpers.draft.simulate import DraftSettings, SimSequence, simulate_sequences, summary
from helpers.draft.training_log import read_training_log
from helpers.paths import REFERENCE_TRAINING, REFERENCE_VALIDATION

from .faultgen import DRAFT, TARGET, TRAINED_PLAN, GenFault

CLEAN = DraftSettings.chain(3)
REQUIRED = ("draft", "wiring", "engine", "settings")


class PerturbedDraft(Eagle3Draft):
    """The draft as a server with ``perturb_factory`` hooks on ``model.fc`` / ``model.layers.0.hidden_norm`` computes
    it: ``out * scale + noise * rms(out) * N(0, 1)`` on those outputs (``helpers.hooks.perturb_factory``), the
    checkpoint untouched."""

    def __init__(self, base: Eagle3Draft, specs: list[dict]):
        super().__init__(base.arch, base.w, base.embed, base.lm_head, base.hot_token_id, dtype=base.dtype,
                         sources=base.sources)
        self._cfg = {s["target_modules"][0]: s["config"] for s in specs}
        self._gen = {m: torch.Generator().manual_seed(int(c.get("seed", 0))) for m, c in self._cfg.items()}

    def _perturb(self, module: str, t: torch.Tensor) -> torch.Tensor:
        c = self._cfg.get(module)
        if c is None:
            return t
        x = t * float(c.get("scale", 1.0))
        if c.get("noise"):
            rms = t.float().pow(2).mean(-1, keepdim=True).sqrt()
            x = x + (float(c["noise"]) * rms * torch.randn(t.shape, generator=self._gen[module])).to(t.dtype)
        return x

    def project(self, aux: torch.Tensor) -> torch.Tensor:
        return self._perturb("model.fc", super().project(aux))

    def _layer_in(self, i, embeds, h, residual):
        if i != 0 or "model.layers.0.hidden_norm" not in self._cfg:
            return super()._layer_in(i, embeds, h, residual)
        a, w, p = self.arch, self.w, "layers.0."
        hn = self._perturb("model.layers.0.hidden_norm", _rms(h, w[p + "hidden_norm.weight"], a.eps))
        return torch.cat([_rms(embeds, w[p + "input_layernorm.weight"], a.eps), hn], dim=-1), h


def greedy_reference(out: Path, *, prompts: int = 16, new_tokens: int = 32) -> tuple[Path, list[SimSequence]]:
    """The bundled prompts continued greedily by the target, and an every-layer HF dump of the whole sequences.
    Returns ``(dump, like)``: ``like`` holds each sequence's tokens and where its continuation starts."""
    # lazy: transformers takes seconds to import; only this fixture needs it
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from helpers.capture import capture_reference_hf

    tok = AutoTokenizer.from_pretrained(TARGET)
    model = AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()
    seqs, like = [], []
    with compute_threads(1):              # a tiny model: one thread (two wait on each other on a loaded machine)
        for p in load_prompts(None, n=prompts):
            ids = tok(p.text)["input_ids"]
            with torch.no_grad():
                full = model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False,
                                      pad_token_id=tok.pad_token_id, eos_token_id=None)[0].tolist()
            seqs.append(Prompt(id=p.id, input_ids=tuple(full)))
            like.append(SimSequence(p.id, torch.tensor(full), torch.zeros(0), len(ids)))
        dump = capture_reference_hf(TARGET, seqs, out, name="greedy-every-layer", progress=False)
    return dump, like


class OfflineMatrix:
    """Everything shared by the draws: the clean draft, its log and teacher-forced pass, the greedy sequences with
    every layer, the draft cost."""

    def __init__(self, tmp: Path, *, prompts: int = 16, truth_prompts: int = 64, new_tokens: int = 32):
        self.tmp = Path(tmp)
        self.n = prompts
        self.log_path = DRAFT / "training_log.json"
        self.log = read_training_log(self.log_path)
        self.draft = Eagle3Draft.load(DRAFT, TARGET)
        self.clean_rows = self._rows(self.draft, DRAFT)
        self.ref, self.like = greedy_reference(self.tmp, prompts=max(prompts, truth_prompts), new_tokens=new_tokens)
        self._plans: dict[tuple, list[SimSequence]] = {}
        self.cost, self.cost_src = draft_cost(DRAFT, TARGET)
        self.clean_frame = simulate_sequences(self.draft, self.states(TRAINED_PLAN), [CLEAN])["per_request"][CLEAN]

    def _rows(self, draft: Eagle3Draft, folder: Path) -> dict:
        return draft_rows(draft, draft_dir=folder, target_dir=TARGET, training=REFERENCE_TRAINING, hidden_size=128,
                          log=self.log, log_path=self.log_path, validation=REFERENCE_VALIDATION)

    def states(self, plan) -> list[SimSequence]:
        """The greedy sequences with the aux states of ``plan`` (tensor names of the every-layer reference)."""
        key = tuple(plan)
        if key not in self._plans:
            self._plans[key] = plan_sequences(self.ref, list(plan), self.like)
        return self._plans[key]

    def settings_loss(self, settings: tuple[int, int, int]) -> float:
        """The accept length (tokens per verify step) that ``settings`` lose against the clean server's chain
        (steps 3) when that chain dominates them in the budget's cost model (it accepts more and its modelled tokens
        per unit time, accept length / (1 + steps x draft cost), is at least theirs); 0 when it does not (settings
        modelled faster than the clean chain trade accepted tokens for throughput: the budget notes the trade, it is
        not a loss). On all the greedy sequences with the clean draft, computed here, independently of the budget's
        settings stage."""
        st = DraftSettings(*settings)
        r = simulate_sequences(self.draft, self.states(TRAINED_PLAN), sorted({st, CLEAN}, key=lambda x: (x.topk, x.steps)))
        al = {g: summary(r["per_request"][g], g.steps)["accept_length"] for g in (st, CLEAN)}
        return dominated_loss(al[CLEAN], al[st], 1 + CLEAN.steps * self.cost, 1 + st.steps * self.cost)

    def run(self, f: GenFault) -> dict:
        """The budget on one fault, with its true offline loss. Returns a JSON-able record."""
        t0 = time.monotonic()
        folder = f.draft_copy(self.tmp / f"draft-{f.seed}")
        draft = self.draft if folder == DRAFT else Eagle3Draft.load(folder, TARGET)
        rows = self.clean_rows if folder == DRAFT else self._rows(draft, folder)
        st = DraftSettings(*f.settings).check()
        train = self.states(TRAINED_PLAN)[: self.n]
        served_all = self.states(f.served_plan())
        served = served_all[: self.n]
        live_draft = PerturbedDraft(draft, f.hook_specs()) if f.cls == "hook" else draft
        live_all = simulate_sequences(live_draft, served_all, [st])["per_request"][st]
        live = live_all[live_all["prompt_id"].isin({s.key for s in served})].reset_index(drop=True)
        e = paired_effect(self.clean_frame, live_all)
        b = acceptance_budget(draft, BudgetInputs(
            settings=st, **budget_fields(rows, self.log), training=train, served_training=served,
            live_sequences=served, live=live, max_new_tokens=None, draft_cost=self.cost,
            draft_cost_source=self.cost_src), required=REQUIRED)
        extra = {"settings_loss": self.settings_loss(f.settings)} if f.cls == "settings" else {}
        return record(f, b, loss=-e["accept_length_delta"],
                      loss_ci=[-e["accept_length_delta_hi"], -e["accept_length_delta_lo"]],
                      wall_s=time.monotonic() - t0, **extra)


def record(f: GenFault, b: Optional[dict], *, loss: Optional[float], loss_ci, wall_s: float, **extra) -> dict:
    """One row of the matrix: the fault, its true loss, what the budget named, each stage's loss and decision."""
    losses = {} if b is None else {k: {"delta": v.get("delta"), "ci": v.get("ci"), "decision": v.get("decision"),
                                       "threshold": v.get("threshold")} for k, v in (b.get("losses") or {}).items()}
    best = next((x for x in (b or {}).get("stages", []) if x["name"] == "best settings (simulated)"), {})
    extra.setdefault("settings_gain", best.get("modelled_speedup_gain"))
    extra.setdefault("recommended", None if b is None else b.get("recommended_settings"))
    return {**f.to_json(), "loss": loss, "loss_ci": loss_ci, "cause": None if b is None else b["cause"],
            "losses": losses, "sentence": None if b is None else b["sentence"], "wall_s": round(wall_s, 1), **extra}


# ------------------------------------------------------------------------------------------------ the table

NAMED = ("none", "draft", "wiring", "engine", "settings", "workload", "undecided")
TRUE = ("none", "draft", "wiring", "settings", "engine")
#: a true loss at or above this (tokens per verify step) must never be put at ``none``
MATERIAL_LIVE = 0.2


def confusion(rows: list[dict], *, named_key: str = "cause") -> dict:
    """``{true stage: {named cause: count}}`` over ``rows`` (undecided a column of its own)."""
    t = {s: {n: 0 for n in NAMED} for s in TRUE}
    for r in rows:
        n = r.get(named_key) or "error"
        t[r["stage"]].setdefault(n, 0)
        t[r["stage"]][n] += 1
    return t


def dominated_loss(al_clean: float, al_served: float, cost_clean: float, cost_served: float) -> float:
    """The accept length the served settings lose against the clean chain when the clean chain dominates them in the
    cost model (``al / cost`` at least theirs, ``cost`` = 1 + steps x draft cost), else 0: a trade, not a loss."""
    if al_clean > al_served and al_clean / cost_clean >= al_served / cost_served:
        return float(al_clean - al_served)
    return 0.0


def budget_loss(r: dict) -> Optional[float]:
    """The true loss the budget answers for: the accept-length loss; for a settings draw, the accept length lost to
    settings the clean chain dominates in the cost model (``settings_loss``: 0 for a trade)."""
    return r["settings_loss"] if r.get("settings_loss") is not None else r.get("loss")


def goal_checks(rows: list[dict], *, loss=budget_loss) -> dict:
    """The goal's counts: wrong causes (a counted cause other than the true stage; on a clean draw any counted
    cause is a false alarm), ``none`` on a material true loss (``loss(row)``: :func:`budget_loss` by default), and
    the undecided draws (with their losses)."""
    counted = ("draft", "wiring", "engine", "settings", "workload")
    wrong = [r for r in rows if r["cause"] in counted and r["stage"] != "none" and r["cause"] != r["stage"]]
    false_alarm = [r for r in rows if r["stage"] == "none" and r["cause"] in counted]
    missed = [r for r in rows if r["cause"] == "none" and loss(r) is not None and loss(r) >= MATERIAL_LIVE]
    undecided = [r for r in rows if r["cause"] == "undecided"]
    return {"wrong_cause": wrong, "false_alarm": false_alarm, "none_on_material_loss": missed,
            "undecided": undecided}


def table_markdown(t: dict) -> str:
    """The confusion table as markdown (rows: true stage; columns: named cause)."""
    cols = [c for c in NAMED if any(t[s].get(c) for s in t)] or ["none"]
    extra = sorted({c for s in t for c in t[s] if c not in NAMED and t[s][c]})
    cols += extra
    out = ["| true \\ named | " + " | ".join(cols) + " | total |", "|---|" + "---|" * (len(cols) + 1)]
    for s in t:
        n = sum(t[s].values())
        if n:
            out.append(f"| {s} | " + " | ".join(str(t[s].get(c, 0)) for c in cols) + f" | {n} |")
    return "\n".join(out)


def fmt(x) -> str:
    return "n/a" if x is None or (isinstance(x, float) and not np.isfinite(x)) else f"{x:.2f}"
