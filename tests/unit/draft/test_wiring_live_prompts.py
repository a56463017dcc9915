"""The wiring stage measured again on the live prompts (helpers.draft.budget._wiring_on_live_prompts): when the
training samples leave it undecided, the draft on the training data's layer plan (an every-layer reference of the
live prompts' tokens) against the states the server fed for the same tokens, paired per prompt, decides it.

Real tensors: the reference target continued greedily on the bundled prompts, every layer recorded by HF
transformers; the served states of a wiring fault (config ids [0, 2, 3], which SGLang 0.5.23 serves as out(1), out(2),
out(3) on this Llama target instead of the trained out(1), out(3), out(4)) taken from the same dump."""
from __future__ import annotations

import pytest

from helpers.capture import capture_reference_hf
from helpers.draft.budget import BudgetInputs, acceptance_budget, draft_cost, plan_sequences, training_sequences
from helpers.draft.model import Eagle3Draft
from helpers.draft.simulate import DraftSettings
from helpers.formats.training_data import TrainingData
from helpers.paths import REFERENCE_TRAINING
from support.fault_offline import greedy_reference
from support.faultgen import DRAFT, SYSTEMS, TARGET, TRAINED_PLAN

SHIFTED = list(SYSTEMS["llama"].plan_for([0, 2, 3]).tensors)
ST = DraftSettings.chain(3)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("wiring-live")
    draft = Eagle3Draft.load(DRAFT, TARGET)
    live_ref, like = greedy_reference(tmp, prompts=16, new_tokens=32)
    td = TrainingData(REFERENCE_TRAINING, hidden_size=128, max_samples=3)
    train = training_sequences(td)
    train_ref = capture_reference_hf(TARGET, list(TrainingData(REFERENCE_TRAINING, hidden_size=128, max_samples=3)),
                                     tmp, name="training-every-layer", progress=False)
    cost, src = draft_cost(DRAFT, TARGET)
    return {"draft": draft, "train": train, "cost": cost, "src": src,
            "train_plan": lambda plan: plan_sequences(train_ref, plan, train),
            "live_plan": lambda plan: plan_sequences(live_ref, plan, like)}


def _budget(w, *, served_training_plan, live_plan, live_trained=True):
    served_live = w["live_plan"](live_plan)
    return acceptance_budget(w["draft"], BudgetInputs(
        settings=ST, training=w["train"], served_training=w["train_plan"](served_training_plan),
        live_sequences=served_live, live_trained=w["live_plan"](list(TRAINED_PLAN)) if live_trained else None,
        max_new_tokens=32, draft_cost=w["cost"], draft_cost_source=w["src"]), required=("wiring",))


def test_the_served_plan_differs_from_the_trained_one():
    assert SHIFTED != list(TRAINED_PLAN) and len(SHIFTED) == 3


def test_a_shift_the_training_samples_leave_undecided_counts_on_the_live_prompts(world):
    """On 3 training samples the shift is undecided (few sequences); on the 16 live prompts' tokens it counts, and
    the training samples' measurement is kept beside it."""
    without = _budget(world, served_training_plan=SHIFTED, live_plan=SHIFTED, live_trained=False)
    assert without["losses"]["wiring"]["decision"] == "undecided", without["sentence"]
    b = _budget(world, served_training_plan=SHIFTED, live_plan=SHIFTED)
    w = b["losses"]["wiring"]
    assert w["decision"] == "counts" and w["n"] == 16 and "live prompts' tokens" in w["basis"], w
    assert w["also"][0]["decision"] == "undecided" and w["also"][0]["delta"] == without["losses"]["wiring"]["delta"]
    assert b["cause"] == "wiring"
    names = [s["name"] for s in b["stages"]]
    assert names.index("offline on live prompts, training plan") == names.index("offline on served states") + 1
    st = next(s for s in b["stages"] if s["name"] == "offline on live prompts, training plan")
    assert st["sequences"] == 16 and st["accept_length"] > w["delta"] >= w["threshold"]


def test_live_prompts_fed_the_trained_plan_clear_the_stage(world):
    """The same undecided training measurement, while the live prompts were fed the trained plan: the live
    measurement is an exact identity, so the stage is clear."""
    b = _budget(world, served_training_plan=SHIFTED, live_plan=list(TRAINED_PLAN))
    w = b["losses"]["wiring"]
    assert w["decision"] == "clear" and w["delta"] == 0, w
    assert w["also"][0]["decision"] == "undecided"


def test_a_decided_training_measurement_is_not_measured_again(world):
    """The trained plan on the training samples is an exact identity (clear): the live prompts are not used."""
    b = _budget(world, served_training_plan=list(TRAINED_PLAN), live_plan=SHIFTED)
    assert b["losses"]["wiring"]["decision"] == "clear" and "also" not in b["losses"]["wiring"]
    assert "offline on live prompts, training plan" not in [s["name"] for s in b["stages"]]


def test_the_budget_table_says_where_the_wiring_stage_was_decided(world):
    """The page's budget table: the wiring row carries the loss decided on the live prompts and the training samples'
    undecided figure; the live training-plan row is its own like-with-like run."""
    from helpers.views.budget import ladder_frame

    b = _budget(world, served_training_plan=SHIFTED, live_plan=SHIFTED)
    t = ladder_frame(b).set_index("stage")
    assert t.loc["offline on served states", "decision"] == "counts"
    assert "measured again on the live prompts' tokens" in t.loc["offline on served states", "note"]
    assert "undecided" in t.loc["offline on served states", "note"]
    assert t.loc["offline on live prompts, training plan", "like with like"] == \
        "drafting chain, live prompts, training plan"


def test_the_table_keeps_the_training_figure_when_a_measured_fix_replaces_the_loss(world):
    """After the restart the measured fix is the wiring loss (story.reconcile puts the ladder's estimate under
    ``ladder``, the rest under ``also``): the note still gives the training samples' undecided figure."""
    from helpers.investigation.story import _merge
    from helpers.views.budget import ladder_frame

    b = _budget(world, served_training_plan=SHIFTED, live_plan=SHIFTED)
    tr = b["losses"]["wiring"]["also"][0]
    _merge(b["losses"], "wiring", {"stage": "wiring", "delta": 0.43, "ci": [0.31, 0.55], "decision": "counts",
                                   "basis": "measured: the proposed fix moved live accept length"}, on_server=True)
    note = ladder_frame(b).set_index("stage").loc["offline on served states", "note"]
    assert "measured on the server" in note and "measured again on the live prompts' tokens" in note
    assert f"{tr['delta']:.2f}" in note and "undecided" in note
