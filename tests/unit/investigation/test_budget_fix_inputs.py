"""The proposed fix applied offline in the acceptance budget, every part of it: a fix that rewires the ids AND replaces
the d2t gets its vocab map measured at the draft stage (teacher-forced on the validation rows, whose aux states are
the training data's own, so the plan does not enter), on the trained head_dim-64 draft with a d2t of another run."""
from __future__ import annotations

from pathlib import Path

import torch

from helpers.draft.draft_stage import draft_rows, draft_stage
from helpers.draft.model import Eagle3Draft
from helpers.draft.training_log import find_training_log, read_training_log
from helpers.investigation.acceptance import _fix_inputs
from helpers.records import ProposedFix
from support import ROOT
from support.drafts import wrong_d2t_draft

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
