"""The acceptance budget's page parts from a real budget (the reference draft offline on its training samples and on
a damaged copy): the stages table, the waterfall and ladder figures with the computed values, escaping."""
from __future__ import annotations

import plotly.graph_objects as go

from helpers.draft.budget import BudgetInputs, acceptance_budget, draft_cost, training_sequences
from helpers.draft.draft_stage import budget_fields, draft_rows
from helpers.draft.model import Eagle3Draft
from helpers.draft.simulate import DraftSettings
from helpers.draft.training_log import predicted_accept_length, read_training_log
from helpers.formats.training_data import TrainingData
from helpers.paths import REFERENCE_DRAFT, REFERENCE_TARGET, REFERENCE_TRAINING, REFERENCE_VALIDATION
from helpers.plots.budget import budget_ladder, budget_waterfall
from helpers.views.budget import budget_parts, ladder_frame, losses_frame, stages_frame
from support.drafts import damaged_draft


def test_budget_parts_show_the_computed_stages(tmp_path):
    seqs = training_sequences(TrainingData(REFERENCE_TRAINING, hidden_size=128))
    tl = read_training_log(REFERENCE_DRAFT / "training_log.json")
    log = predicted_accept_length(tl, 3)
    cost, src = draft_cost(REFERENCE_DRAFT, REFERENCE_TARGET)
    d = damaged_draft(tmp_path / "d", noise=2.0)
    draft = Eagle3Draft.load(d, REFERENCE_TARGET)
    dr = draft_rows(draft, draft_dir=d, target_dir=REFERENCE_TARGET, training=REFERENCE_TRAINING, hidden_size=128,
                    log=tl, log_path=None, validation=REFERENCE_VALIDATION)
    b = acceptance_budget(draft, BudgetInputs(settings=DraftSettings.chain(3), **budget_fields(dr, tl), training=seqs,
                                              draft_cost=cost, draft_cost_source=src))
    b["losses"]["draft"]["basis"] += " <script>alert(1)</script>"          # file-provided text is escaped
    st = stages_frame(b)
    assert list(st["stage"][:3]) == ["training log", "checkpoint (teacher-forced)", "offline on training states"]
    assert abs(st["accept length"][0] - round(log["accept_length"], 2)) < 1e-9
    losses = losses_frame(b)
    assert losses.set_index("stage").loc["draft", "counts"] == "yes"
    wf = budget_waterfall(b)
    assert isinstance(wf, go.Figure) and wf.data[0].text[1] == f"{b['stages'][1]['accept_length']:.2f}"
    lad = budget_ladder(b)
    assert list(lad.data[0].y) == b["stages"][0]["p_accept_ge"]
    lad = ladder_frame(b).set_index("stage")
    ds = b["stages"][1]
    assert lad.loc["checkpoint (teacher-forced)", "accept length [95% CI]"] == \
        f"{ds['accept_length']:.2f} [{ds['ci'][0]:.2f}, {ds['ci'][1]:.2f}]"
    assert lad.loc["checkpoint (teacher-forced)", "decision"] == "counts"
    assert lad.loc["checkpoint (teacher-forced)", "lost at this stage [95% CI]"].startswith(
        f"{b['losses']['draft']['delta']:.2f} [")
    assert lad.loc["training log", "like with like"].startswith("trainer's formula") and \
        lad.loc["checkpoint (teacher-forced)", "like with like"] == ""          # one run, named once
    html = "".join(p for p in budget_parts(b) if isinstance(p, str))
    assert "<script>alert(1)" not in html and "&lt;script&gt;" in html and "<b>Cause: draft</b>" in html
    assert budget_parts(None) == ["<p>No acceptance budget in this run.</p>"]
