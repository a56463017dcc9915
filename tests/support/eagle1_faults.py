"""Generated faults of an EAGLE-1 draft served by vLLM (``method: eagle``, ``env/models/llama_h64/draft_eagle1``),
drawn from a seed: a class and a strength, each knowing the stage of the single-state budget
(:mod:`helpers.investigation.mtp` with the :data:`helpers.investigation.single_state.EAGLE1` profile) that should
name it. A test fixture, off by default; no flag of the tool reaches it.

Classes (the stage that should name them, :data:`STAGE`):

* ``clean`` (none): no fault.
* ``fc_swap`` (draft): the two halves of ``fc.weight`` swapped (``[H, 2H]``: columns ``:H`` read ``embed(x_{t+1})``,
  ``H:`` read ``h_t``, ``vllm/model_executor/models/llama_eagle.py::LlamaModel.forward``): a conversion that
  concatenated the other way round.
* ``fc_scale`` (draft): one drawn half of ``fc.weight`` scaled by a factor log-uniform in 1/16 .. 1/2 or 2 .. 16 (a
  wrong quantisation scale).
* ``residual_missing`` (engine): the serving engine drops the draft's residual (``out = y`` instead of
  ``y + residual`` at the end of ``llama_eagle.py::LlamaModel.forward``): a public report's EAGLE-1 port. vLLM
  0.32.0 has no hook for it here, so the "live" counters are the faulty draft's own chains on the served states
  (:class:`ResidualMissing`), while the offline stages run the correct draft.
* ``pre_norm`` (wiring, ``norm_mismatch``): the draft fed the target's last layer output before its final norm,
  ``out(n-1)``, where vLLM feeds ``norm(out(n-1))`` (no vLLM hook either: the served states are the reference's
  ``out(n-1)``, :func:`support.mtp_faults.served_states`).

Checkpoint faults are written into a copy of the draft folder (:func:`write_faulty_draft`) whose training log points
at the committed validation rows.
"""
from __future__ import annotations

import json
import math
import random
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from . import ROOT

H64 = ROOT / "env" / "models" / "llama_h64"
TARGET, DRAFT = H64 / "target", H64 / "draft_eagle1"
CLASSES = ("clean", "fc_swap", "fc_scale", "residual_missing", "pre_norm")
STAGE = {"clean": "none", "fc_swap": "draft", "fc_scale": "draft", "residual_missing": "engine", "pre_norm": "wiring"}
#: the served chain (vLLM num_speculative_tokens) the faults are judged at (server start's default for the pair)
STEPS = 3


@dataclass
class Eagle1Fault:
    """One drawn fault: ``kind`` (:data:`CLASSES`), its strength in ``params``, the stage that should name it."""

    seed: int
    kind: str
    params: dict = field(default_factory=dict)

    @property
    def stage(self) -> str:
        return STAGE[self.kind]

    @property
    def checkpoint(self) -> bool:
        """The fault is in the draft's weights (a faulty draft folder is written)."""
        return self.kind in ("fc_swap", "fc_scale")

    def to_json(self) -> dict:
        return {"seed": self.seed, "kind": self.kind, "stage": self.stage, **self.params}


def draw(seed: int, kinds: tuple[str, ...] = CLASSES) -> Eagle1Fault:
    """The fault of ``seed``: a class drawn uniformly from ``kinds``, then its strength."""
    r = random.Random(seed)
    kind = r.choice(kinds)
    p: dict = {}
    if kind == "fc_scale":
        lo, hi = r.choice([(1 / 16, 1 / 2), (2.0, 16.0)])
        p = {"half": r.choice(["embed", "hidden"]), "factor": math.exp(r.uniform(math.log(lo), math.log(hi)))}
    elif kind == "pre_norm":
        p = {"layer": int(json.loads((TARGET / "config.json").read_text())["num_hidden_layers"]) - 1}
    return Eagle1Fault(seed, kind, p)


def write_faulty_draft(fault: Eagle1Fault, out: Path, draft: Path = DRAFT) -> Path:
    """A copy of ``draft`` with ``fault`` (a checkpoint class) applied to ``fc.weight``; its training log's
    ``validation_rows.path`` made absolute (the committed rows). Returns ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(draft / "config.json", out / "config.json")
    w = load_file(str(draft / "model.safetensors"))
    fc = w["fc.weight"].clone()
    H = fc.shape[0]
    if fault.kind == "fc_swap":
        fc = torch.cat([fc[:, H:], fc[:, :H]], dim=1)
    elif fault.kind == "fc_scale":
        cols = slice(0, H) if fault.params["half"] == "embed" else slice(H, 2 * H)
        fc[:, cols] = (fc[:, cols].float() * fault.params["factor"]).to(fc.dtype)
    w["fc.weight"] = fc.contiguous()
    save_file(w, str(out / "model.safetensors"), metadata={"format": "pt"})
    log = json.loads((draft / "training_log.json").read_text())
    log["validation_rows"]["path"] = str((draft / log["validation_rows"]["path"]).resolve())
    (out / "training_log.json").write_text(json.dumps(log, indent=2) + "\n")
    return out


def residual_missing(head):
    """``head`` (a loaded :class:`helpers.draft.eagle1.Eagle1Draft`) as an engine that drops its residual would run
    it: a :class:`ResidualMissing` sharing the weights."""
    from helpers.draft.eagle1 import Eagle1Draft

    class ResidualMissing(Eagle1Draft):
        def _finish(self, m, residual):
            return super()._finish(m, torch.zeros_like(residual))

    faulty = object.__new__(ResidualMissing)
    faulty.__dict__.update(head.__dict__)
    return faulty


def offline_budget(fault: Eagle1Fault, tmp: Path, world, *, steps: int = STEPS) -> dict:
    """The EAGLE-1 budget's stages offline (no server) on ``fault``: the draft stage on the (faulty) draft against
    its log on the committed rows, the served state identified (:func:`helpers.investigation.mtp.identify_state` on
    the state the fault feeds), and :func:`helpers.investigation.mtp.mtp_budget` with the EAGLE-1 profile on the
    live prompts of ``world`` (:func:`support.mtp_faults.served_world` on the llama_h64 target), the "live" counters
    the chains the serving engine runs (the faulty draft for ``residual_missing``, else the served draft on the served
    states, as measured live: engine loss 0).

    Returns ``{"named": stages that name a fault (["none"] when all three losses are clear and the state is right,
    ["undecided"] when nothing is named but a loss stays undecided), "findings", "losses": {stage: {delta, ci,
    decision}}, "accept_lengths", "seconds"}``."""
    from helpers.draft.loader import load_draft
    from helpers.draft.simulate import DraftSettings, simulate_sequences
    from helpers.investigation.mtp import identify_state, mtp_budget, reference_sequences, state_findings
    from helpers.investigation.single_state import EAGLE1
    from .mtp_faults import served_states
    t0 = time.monotonic()
    folder = write_faulty_draft(fault, tmp / f"draft-{fault.seed}") if fault.checkpoint else DRAFT
    head = load_draft(folder, TARGET)
    seqs, ref, w, eps = world
    served = served_states(world, fault)
    refs = reference_sequences(ref, seqs, w, eps)
    ident = identify_state(served, ref, w, eps)
    ident.update(source=EAGLE1.feed_source, engine=EAGLE1.engine)
    st = DraftSettings(steps, 1, steps + 1)
    n_new = max(len(x.tokens) - x.start for x in seqs)
    engine_head = residual_missing(head) if fault.kind == "residual_missing" else head
    live = simulate_sequences(engine_head, served, [st], max_new_tokens=n_new)["per_request"][st]
    ds = EAGLE1.draft_stage(head, TARGET, steps, draft_dir=folder)
    b = mtp_budget(head, served, refs, live, st, max_new_tokens=n_new, draft=ds, profile=EAGLE1)
    found = [f["kind"] for f in state_findings(ident, b["losses"]["wiring"], EAGLE1)]
    named = [k for k in ("draft", "wiring", "engine") if b["losses"][k]["decision"] == "counts"]
    if found and "wiring" not in named:
        named.append("wiring")
    if not named:
        named = ["none"] if b["cause"] == "none" else ["undecided"]
    return {"fault": fault.to_json(), "named": named, "findings": found, "served_state": ident["best"],
            "losses": {k: {x: v.get(x) for x in ("delta", "ci", "decision", "threshold")}
                       for k, v in b["losses"].items()},
            "accept_lengths": {s["name"]: s.get("accept_length") for s in b["stages"]}, "cause": b["cause"],
            "seconds": round(time.monotonic() - t0, 1)}


__all__ = ["CLASSES", "DRAFT", "Eagle1Fault", "STAGE", "STEPS", "TARGET", "draw", "offline_budget",
           "residual_missing", "write_faulty_draft"]
