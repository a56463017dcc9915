"""The wiring stage measured on the live prompts too (helpers.draft.budget._wiring_on_live_prompts): the draft on the
training data's layer plan (an every-layer reference of the live prompts' tokens) against the states the server fed
for the same tokens, paired per prompt, decides it, unless the training samples count a loss it does not.

Real tensors: the reference target continued greedily on the bundled prompts, every layer recorded by HF
transformers; the served states of a wiring fault (config ids [0, 2, 3], which SGLang 0.5.23 serves as out(1), out(2),
out(3) on this Llama target instead of the trained out(1), out(3), out(4)) taken from the same dump."""
from __future__ import annotations

import pytest

from helpers.capture import capture_reference_hf
from helpers.draft.budget import (SAME_STATES, BudgetInputs, acceptance_budget, draft_cost, plan_sequences,
                                  states_difference, training_sequences)
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


def _budget(w, *, served_training_plan, live_plan, live_trained=True, max_new_tokens=32):
    served_live = w["live_plan"](live_plan)
    return acceptance_budget(w["draft"], BudgetInputs(
        settings=ST, training=w["train"], served_training=w["train_plan"](served_training_plan),
        live_sequences=served_live, live_trained=w["live_plan"](list(TRAINED_PLAN)) if live_trained else None,
        max_new_tokens=max_new_tokens, draft_cost=w["cost"], draft_cost_source=w["src"]), required=("wiring",))


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


def test_a_fault_on_the_live_prompts_counts_though_the_training_samples_clear_it(world):
    """The training samples were fed the trained plan (an exact identity: clear) while the live prompts get the shift:
    the live prompts count the loss (a fault on the prompts served is not cleared by the training samples), the
    training samples' clear measurement kept beside it, and the cause is wiring."""
    b = _budget(world, served_training_plan=list(TRAINED_PLAN), live_plan=SHIFTED)
    w = b["losses"]["wiring"]
    assert w["decision"] == "counts" and "live prompts' tokens" in w["basis"], w
    assert w["also"][0]["decision"] == "clear" and w["also"][0]["delta"] == 0
    assert b["cause"] == "wiring"


def test_a_loss_the_training_samples_count_is_kept_when_the_live_prompts_clear_it(world):
    """The combination rule itself: a wiring loss the training samples count stays the wiring loss when the live
    prompts (fed the trained plan: the same tensors) clear it; the live measurement is kept beside it."""
    from helpers.draft.budget import _Ladder, _wiring_on_live_prompts
    from helpers.draft.simulate import simulate_sequences

    counted = {"stage": "wiring", "delta": 0.5, "ci": [0.3, 0.7], "decision": "counts", "basis": "training"}
    L = _Ladder(S=ST.steps, losses={"wiring": dict(counted)})
    live = world["live_plan"](list(TRAINED_PLAN))
    inp = BudgetInputs(settings=ST, live_sequences=live, live_trained=world["live_plan"](list(TRAINED_PLAN)),
                       max_new_tokens=32)
    _wiring_on_live_prompts(L, inp, lambda seqs, st, mnt=None: simulate_sequences(world["draft"], seqs, st,
                                                                                 max_new_tokens=mnt))
    w = L.losses["wiring"]
    assert w["decision"] == "counts" and w["delta"] == 0.5
    assert w["also"][0]["decision"] == "clear" and "live prompts' tokens" in w["also"][0]["basis"]


def test_the_states_difference_tells_the_same_tensors_from_a_layer_off(world):
    """The served states at the trained plan are the reference's own tensors (difference 0); the shift (two chunks a
    layer early) differs by far more than SAME_STATES."""
    trained = world["live_plan"](list(TRAINED_PLAN))
    assert states_difference(world["live_plan"](list(TRAINED_PLAN)), trained) == 0
    assert states_difference(world["live_plan"](SHIFTED), trained) > 4 * SAME_STATES


@pytest.mark.parametrize("max_new_tokens", [1, 2])
def test_too_few_tokens_per_prompt_never_clear_a_shift(world, max_new_tokens):
    """With a token or two per prompt the two arms can give the same verify steps on every prompt while the server
    feeds a layer early: the identity of outcomes is not evidence when the states differ, so the stage is undecided
    (never clear) and says that more tokens per prompt would settle it."""
    b = _budget(world, served_training_plan=list(TRAINED_PLAN), live_plan=SHIFTED, max_new_tokens=max_new_tokens)
    w = b["losses"]["wiring"]
    assert w["decision"] != "clear" and b["cause"] != "none", w
    if w["decision"] == "undecided" and w.get("states_difference", 0) >= SAME_STATES and \
            all(x == 0 for x in (w.get("small_n") or {}).get("per_sequence") or [1]):
        assert "--max-new-tokens" in w["settle"]["text"]


def test_the_budget_table_says_where_the_wiring_stage_was_decided(world):
    """The page's budget table: the wiring row carries the loss decided on the live prompts and the training samples'
    undecided figure; the live training-plan row is its own like-with-like run."""
    from helpers.views.budget import ladder_frame

    b = _budget(world, served_training_plan=SHIFTED, live_plan=SHIFTED)
    t = ladder_frame(b).set_index("stage")
    assert t.loc["offline on served states", "decision"] == "counts"
    assert "measured on the live prompts' tokens too" in t.loc["offline on served states", "note"]
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
    assert "measured on the server" in note and "measured on the live prompts' tokens too" in note
    assert f"{tr['delta']:.2f}" in note and "undecided" in note


def test_a_fix_proven_on_one_verify_step_per_sample_is_not_withdrawn(world):
    """The proposed fix (the trained plan) against the shifted served states on training samples cut to two generated
    tokens: both give the same verify step on each of the 3 samples, while the states differ by far more than
    SAME_STATES. That identity is no evidence the fix gains nothing: its decision is undecided, not clear (a clear
    one withdraws the fix)."""
    from helpers.draft.simulate import SimSequence
    from helpers.investigation.acceptance import fix_withdrawal

    def cut(seqs, k=2):
        return [SimSequence(s.key, s.tokens[:s.start + k], s.aux[:s.start + k], s.start,
                            None if s.targets is None else s.targets[:s.start + k]) for s in seqs]

    fix = cut(world["train_plan"](list(TRAINED_PLAN)))
    b = acceptance_budget(world["draft"], BudgetInputs(
        settings=ST, training=cut(world["train"]), served_training=cut(world["train_plan"](SHIFTED)),
        fix={"label": "the training plan", "sequences": fix, "plan": list(TRAINED_PLAN)}, draft_cost=world["cost"]),
        required=("wiring",))
    fo = b["fix_offline"]
    assert fo["gain_per_sequence"] == [0, 0, 0] and fo["states_difference"] > SAME_STATES
    assert fo["decision"] == "undecided" and fix_withdrawal(fo) is None


@pytest.mark.parametrize("max_new_tokens", [2, 32])
def test_a_cap_of_one_verify_step_per_prompt_decides_neither_engine_nor_settings(world, max_new_tokens):
    """The live prompts at the trained plan, the server's counters taken as the offline run of the same states (an
    engine that does what the simulation does). With --max-new-tokens 2 every chain and the server give one verify
    step of 2 tokens per prompt: the engine identity and 'no chain accepts more' are the cap's, so both stages are
    undecided (more tokens per prompt) and no setting is recommended; with 32 tokens both are decided."""
    from helpers.draft.simulate import simulate_sequences

    live_seqs = world["live_plan"](list(TRAINED_PLAN))
    live = simulate_sequences(world["draft"], live_seqs, [ST], max_new_tokens=max_new_tokens)["per_request"][ST]
    b = acceptance_budget(world["draft"], BudgetInputs(
        settings=ST, live_sequences=live_seqs, live=live, max_new_tokens=max_new_tokens, draft_cost=world["cost"],
        draft_cost_source=world["src"]), required=("engine", "settings"))
    e, s = b["losses"]["engine"], b["losses"]["settings"]
    if max_new_tokens == 2:
        assert e["decision"] == s["decision"] == "undecided", (e, s)
        assert "--max-new-tokens" in e["settle"]["text"] and "--max-new-tokens" in s["settle"]["text"]
        assert b["recommended_settings"] == b["settings"] and b["cause"] == "undecided"
    else:
        assert e["decision"] == "clear" and s["decision"] in ("clear", "counts"), (e, s)
