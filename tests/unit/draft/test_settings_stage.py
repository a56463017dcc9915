"""The acceptance budget's settings stage (helpers.draft.budget._settings_stage) on the reference drafts' own training
samples: its loss is accept length, counted against the chain that dominates the served settings in the cost model
(accepts more at a modelled throughput at least theirs); served settings no chain dominates are a trade, noted with
what they give up, never a loss and never "nothing lost" in silence."""
from __future__ import annotations

import pytest

from helpers.draft.budget import (NEAR_BEST, BudgetInputs, acceptance_budget, acceptance_reference, draft_cost,
                                  settings_trade, training_sequences)
from helpers.draft.decide import SMALL_N, threshold
from helpers.draft.model import Eagle3Draft
from helpers.draft.simulate import DraftSettings, simulate_sequences, summary
from helpers.formats.training_data import TrainingData
from support import ROOT

MODELS = ROOT / "env" / "models"
PAIRS = {"llama": (MODELS / "target", MODELS / "draft", MODELS / "data" / "sample"),
         "kimi": (MODELS / "kimi" / "target", MODELS / "kimi" / "draft", MODELS / "kimi" / "data" / "sample")}


@pytest.fixture(scope="module", params=sorted(PAIRS))
def pair(request):
    target, folder, sample = PAIRS[request.param]
    draft = Eagle3Draft.load(folder, target)
    seqs = training_sequences(TrainingData(sample, hidden_size=draft.arch.target_hidden))
    cost, src = draft_cost(folder, target)
    grid = [DraftSettings.chain(k) for k in range(1, 9)]
    r = simulate_sequences(draft, seqs, grid)["per_request"]
    table = []
    for g in grid:
        al = summary(r[g], g.steps)["accept_length"]
        table.append({"steps": g.steps, "topk": 1, "draft_tokens": g.draft_tokens, "accept_length": al,
                      "speedup_model": al / (1 + g.steps * cost)})
    return request.param, draft, seqs, cost, src, table


def _budget(draft, seqs, cost, src, settings):
    return acceptance_budget(draft, BudgetInputs(settings=settings, training=seqs, draft_cost=cost,
                                                 draft_cost_source=src), required=("settings",))


def test_every_chain_the_stage_names_is_dominating_or_a_trade(pair):
    """Over every served chain 1-8: the acceptance reference accepts more and is modelled at least as fast, and is the
    fastest such chain; a trade is named only where nothing dominates, within NEAR_BEST, at least material."""
    name, _, _, _, _, table = pair
    for served in table:
        ref = acceptance_reference(table, served)
        dom = [t for t in table if t is not served and t["accept_length"] > served["accept_length"]
               and t["speedup_model"] >= served["speedup_model"]]
        if not dom:
            assert ref is None
            tr = settings_trade(table, served, threshold(served["accept_length"]))
            if tr is not None:
                assert tr["accept_length"] - served["accept_length"] >= threshold(served["accept_length"])
                assert -NEAR_BEST <= tr["modelled_speedup_change"] < 0, (name, served["steps"], tr)
            continue
        assert ref is max(dom, key=lambda t: t["speedup_model"]), (name, served["steps"])
    # the cost model's best chain is dominated by nothing
    best = max(table, key=lambda t: t["speedup_model"])
    assert acceptance_reference(table, best) is None


def test_steps_one_is_a_settings_loss_with_the_dominating_chain_recommended(pair):
    """--speculative-num-steps 1 accepts fewer tokens than the chains the cost model puts faster: the settings stage
    counts the accept length it loses, recommends the fastest dominating chain, and the cause is settings."""
    name, draft, seqs, cost, src, table = pair
    b = _budget(draft, seqs, cost, src, DraftSettings.chain(1))
    ref = acceptance_reference(table, table[0])
    loss = b["losses"]["settings"]
    assert ref is not None and b["cause"] == "settings", b["sentence"]
    assert b["recommended_settings"]["steps"] == ref["steps"]
    assert loss["decision"] == "counts" and loss["delta"] == pytest.approx(
        ref["accept_length"] - table[0]["accept_length"], abs=0.15), (name, loss, ref)
    assert f"--speculative-num-steps {ref['steps']}" in b["sentence"]


def test_the_cost_models_best_chain_is_clear(pair):
    """Serving the cost model's best chain loses nothing at the settings stage: its CI is an exact identity."""
    name, draft, seqs, cost, src, table = pair
    best = max(table, key=lambda t: t["speedup_model"])
    b = _budget(draft, seqs, cost, src, DraftSettings.chain(best["steps"]))
    assert b["losses"]["settings"]["decision"] == "clear" and b["cause"] == "none", (name, b["sentence"])
    assert b["recommended_settings"]["steps"] == best["steps"]


def test_steps_two_on_the_kimi_draft_is_dominated_by_steps_three():
    """The live case the budget used to clear (Kimi-class target, Llama-style draft, --speculative-num-steps 2: live
    accept length 0.38 below steps 3 at a modelled throughput 4 % lower): on the training samples too, steps 3 accepts
    more and is modelled at least as fast, so the stage counts the loss and recommends steps 3."""
    target, folder, sample = PAIRS["kimi"]
    draft = Eagle3Draft.load(folder, target)
    seqs = training_sequences(TrainingData(sample, hidden_size=draft.arch.target_hidden))
    cost, src = draft_cost(folder, target)
    b = _budget(draft, seqs, cost, src, DraftSettings.chain(2))
    assert b["cause"] == "settings" and b["recommended_settings"]["steps"] == 3, b["sentence"]
    st = next(s for s in b["stages"] if s["name"] == "best settings (simulated)")
    assert st["acceptance_reference"]["modelled_speedup_change"] >= 0
    assert b["losses"]["settings"]["ci"][0] > 0


def test_a_trade_is_named_in_the_sentence_when_nothing_is_lost(pair):
    """Served settings that no chain dominates but that accept materially fewer tokens than a chain modelled within
    NEAR_BEST: cause none (nothing is lost in the cost model) and the sentence says what the settings trade."""
    name, draft, seqs, cost, src, table = pair
    traded = [t for t in table if acceptance_reference(table, t) is None
              and settings_trade(table, t, threshold(t["accept_length"])) is not None]
    if not traded:
        pytest.skip(f"{name}: no undominated chain trades accepted tokens within {NEAR_BEST:.0%} on these samples")
    t = traded[0]
    b = _budget(draft, seqs, cost, src, DraftSettings.chain(t["steps"]))
    tr = b["settings_trade"]
    assert b["cause"] == "none" and tr is not None, b["sentence"]
    assert "the settings' trade, not a fault" in b["sentence"] and f"--speculative-num-steps {tr['steps']}" in \
        b["sentence"]
    assert any("the settings' trade, not a fault" in n for n in b["notes"])


@pytest.mark.parametrize("k", [1, 2, 3])
def test_on_fewer_than_small_n_sequences_the_settings_stage_is_undecided(pair, k):
    """On the first k training samples (fewer than SMALL_N) the settings stage is undecided, with SMALL_N sequences as
    what would settle it, whether a chain dominates the served settings on those samples or none does: never clear,
    never a trade, never counted (on 3 samples of the Kimi-class draft steps 3 came out 0.04 % slower than steps 2 in
    the cost model and the budget said 'cause none'; on 3 Llama samples steps 5 dominated the served steps 3 by 1.15
    tokens, which 16 samples refute)."""
    name, draft, seqs, cost, src, _ = pair
    few = seqs[:k]
    for steps in (1, 2, 3):
        b = _budget(draft, few, cost, src, DraftSettings.chain(steps))
        loss = b["losses"]["settings"]
        assert b["cause"] == "undecided" and loss["decision"] == "undecided", (name, k, steps, loss)
        assert b["settings_trade"] is None
        assert loss["settle"]["n"] >= SMALL_N and f"below {SMALL_N} sequences" in loss["why"], (name, k, steps, loss)


def test_a_faster_chain_that_accepts_fewer_tokens_is_said_in_the_sentence(pair):
    """With a draft step costing 0.9 of a verify step the cost model favours fewer steps than the served 3 by more than
    MATERIAL: no accepted tokens are lost (cause none), and the sentence says what the cost model favours and that it
    is a throughput to measure (the recommendation was only in the notes)."""
    name, draft, seqs, _, _, _ = pair
    b = _budget(draft, seqs, 0.9, "given", DraftSettings.chain(3))
    r = b["recommended_settings"]
    assert b["cause"] == "none" and r["steps"] < 3, (name, b["sentence"])
    assert f"the cost model puts --speculative-num-steps {r['steps']}" in b["sentence"]
    assert "a throughput to measure" in b["sentence"]
