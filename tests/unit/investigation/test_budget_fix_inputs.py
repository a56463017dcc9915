"""The proposed fix applied offline in the acceptance budget, every part of it: a fix that rewires the ids AND replaces
the d2t gets its vocab map measured at the draft stage (teacher-forced on the validation rows, whose aux states are
the training data's own, so the plan does not enter), on the trained head_dim-64 draft with a d2t of another run; and
the story: a d2t finding that names the draft stage does not hide a checkpoint that is below its log anyway."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helpers.draft.budget import BudgetInputs, acceptance_budget
from helpers.draft.draft_stage import draft_rows, draft_stage
from helpers.draft.model import Eagle3Draft
from helpers.draft.simulate import DraftSettings
from helpers.draft.training_log import find_training_log, read_training_log
from helpers.investigation.acceptance import _fix_inputs
from helpers.investigation.story import draft_residual, reconcile
from helpers.records import Finding, InvestigationDoc, ProposedFix
from support import ROOT
from support.drafts import damaged_draft, wrong_d2t_draft

H64 = ROOT / "env" / "models" / "llama_h64"
VOCAB_MAP = H64 / "data" / "sample" / "vocab_mapping" / "vocab_mapping.pt"


def test_a_fix_with_new_ids_and_a_new_d2t_measures_the_vocab_map_at_the_draft_stage(tmp_path: Path):
    draft_dir = wrong_d2t_draft(tmp_path / "draft", src=H64 / "draft")
    draft = Eagle3Draft.load(draft_dir, H64 / "target", dtype=torch.float32)
    log_path = find_training_log(draft_dir, None)
    log = read_training_log(log_path)
    dr = draft_rows(draft, draft_dir=draft_dir, target_dir=H64 / "target", training=H64 / "data" / "sample",
                    hidden_size=128, log=log, log_path=log_path, validation=H64 / "data" / "validation")
    fix = ProposedFix(kind="config", draft_config={"eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 4, 5]}},
                      expected_served=["out(1)", "out(3)", "out(4)"],
                      add_tensors={"d2t": str(VOCAB_MAP), "t2d": str(VOCAB_MAP)})
    fix_in, draft_fix = _fix_inputs(fix, [], ["out(1)", "out(3)", "out(4)"], None, [], None, draft, dr)
    assert draft_fix is not None and draft_fix["label"] == "the proposed vocab map"
    as_served, _ = draft_stage(dr["rows"], dr["kind"], dr["path"], log, 3, labels=dr["labels"])
    fixed, _ = draft_stage(draft_fix["rows"], dr["kind"], dr["path"], log, 3, labels=dr["labels"])
    # another run's d2t maps almost every draft id to the wrong token: nothing is accepted; the training data's
    # vocab map gives back what the checkpoint scored in training (2.31 on these rows, the log says 2.30)
    assert as_served["accept_length"] < 1.05
    assert abs(fixed["accept_length"] - 2.31) < 0.02 and fixed["ci"][0] > 2.2, fixed
    assert fix_in is None             # no every-layer reference and no served capture: no drafting chain to run


def _draft_stage_budget(draft_dir: Path) -> tuple[dict, Eagle3Draft]:
    """The acceptance budget's draft stage (log and checkpoint, with the proposed vocab map paired) of ``draft_dir``
    on the h64 validation rows, as the live budget computes it; the other stages are left out."""
    draft = Eagle3Draft.load(draft_dir, H64 / "target", dtype=torch.float32)
    log_path = find_training_log(draft_dir, None)
    log = read_training_log(log_path)
    dr = draft_rows(draft, draft_dir=draft_dir, target_dir=H64 / "target", training=H64 / "data" / "sample",
                    hidden_size=128, log=log, log_path=log_path, validation=H64 / "data" / "validation")
    fix = ProposedFix(kind="config", add_tensors={"d2t": str(VOCAB_MAP), "t2d": str(VOCAB_MAP)},
                      addresses=["vocab_map_differs"], applicable=True)
    _, draft_fix = _fix_inputs(fix, [], None, None, [], None, draft, dr)
    b = acceptance_budget(draft, BudgetInputs(settings=DraftSettings(3, 1, 4), log=log, draft_rows=dr["rows"],
                                              draft_rows_kind=dr["kind"], draft_rows_path=dr["path"],
                                              draft_rows_labels=dr["labels"], draft_fix=draft_fix),
                          required=("draft",))
    return b, fix


@pytest.mark.parametrize("damaged", [False, True], ids=["wrong-d2t", "wrong-d2t-and-damaged"])
def test_a_d2t_finding_does_not_hide_a_damaged_checkpoint(tmp_path: Path, damaged: bool):
    """Another run's d2t alone: its finding names the draft stage's whole loss (the vocab map gives the log back).
    With noise in fc / attention / MLP too, the vocab map leaves most of the loss: draft_underperforms names it."""
    src = damaged_draft(tmp_path / "damaged", noise=2.0, src=H64 / "draft") if damaged else H64 / "draft"
    b, fix = _draft_stage_budget(wrong_d2t_draft(tmp_path / "draft", src=src))
    assert b["cause"] == "draft" and b["losses"]["draft"]["decision"] == "counts"
    doc = InvestigationDoc(findings=[Finding(kind="vocab_map_differs", detail="d2t unlike the training data's")],
                           acceptance=b, proposed_fix=fix)
    doc = reconcile(doc)
    kinds = [f.kind for f in doc.findings]
    res = draft_residual(doc.acceptance)
    if not damaged:
        assert kinds == ["vocab_map_differs"] and res is None
        return
    # with the training data's vocab map the damaged checkpoint scores 1.29 [1.27, 1.32] where its log says 2.30
    assert res is not None and abs(res["accept_length"] - 1.29) < 0.05 and res["log"] - res["ci"][1] > 0.9, res
    f = next(f for f in doc.findings if f.kind == "draft_underperforms")
    assert f.evidence["residual"] and "vocab_map_differs does not explain" in f.detail, f.detail
    assert kinds.count("draft_underperforms") == 1 and reconcile(doc).findings == doc.findings     # once, idempotent
