"""The layer plan a draft was trained on, identified from the checkpoint alone (helpers.draft.plan_id), on the shipped
reference models with their training data withheld: the HF every-layer reference of the target's own sampled
continuations of held-out prompts is computed here; the training data is read only to know the truth."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from helpers.draft.model import Eagle3Draft
from helpers.draft import plan_id
from helpers.draft.plan_id import (PROVENANCE, Candidate, LayerStates, TargetHead, candidate_plans, identify_plan,
                                   neighbours, reference_from_dump, reference_from_hf)
from helpers.formats.dumps import write_dump
from tests.support import ROOT
from tests.support import faultgen

MODELS = ROOT / "env" / "models"
TARGET, DRAFT, DRAFT_ALT = MODELS / "target", MODELS / "draft", MODELS / "draft_alt"
KIMI = MODELS / "kimi"


def _trained_plan(data) -> tuple[str, ...]:
    """The truth, from the training data's capture.json (SpecForge out(i) ids)."""
    ids = json.loads((data / "capture.json").read_text())["layer_ids"]["specforge_out_i"]
    return tuple(f"out({i})" for i in ids)


def _prompts(target, n: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(target))
    return [tok(p)["input_ids"] for p in json.loads((MODELS / "prompts.json").read_text())["prompts"][:n]]


@pytest.fixture(scope="module")
def llama_ref():
    """8 held-out prompts, each continued 64 tokens by the target sampled at temperature 1, every layer (HF)."""
    return reference_from_hf(TARGET, _prompts(TARGET, 8), new_tokens=64, temperature=1.0, seed=0)


@pytest.fixture(scope="module")
def llama_head():
    return TargetHead.load(TARGET)


@pytest.fixture(scope="module")
def llama_draft():
    return Eagle3Draft.load(DRAFT, TARGET)


def test_candidates_cover_each_reading_defaults_moves_and_orders():
    c = {x.plan: x.origins for x in candidate_plans([1, 3, 4], 8, 3)}
    assert ("out(1)", "out(3)", "out(4)") in c                       # SpecForge out(i) reading and its default
    assert any("SpecForge out(i)" in o for o in c[("out(1)", "out(3)", "out(4)")])
    assert any("SpecForge default" in o for o in c[("out(1)", "out(3)", "out(4)")])
    assert ("out(0)", "out(2)", "out(3)") in c                       # the ids read as in(i)
    assert ("out(2)", "out(3)", "out(4)") in c                       # chunk 0 +1
    assert ("out(2)", "out(4)", "out(5)") in c                       # every chunk +1
    assert ("embedding", "out(1)", "out(3)") in c                    # the embedding prepended
    assert ("embedding", "out(3)", "out(4)") in c                    # the embedding in place of chunk 0
    assert ("out(4)", "out(3)", "out(1)") in c                       # chunk order
    for p in c:
        assert len(set(p)) == 3 and "final_norm" not in p and "out(8)" not in p
    # no ids: the trainers' defaults and their neighbourhood only
    assert ("out(1)", "out(3)", "out(4)") in {x.plan for x in candidate_plans(None, 8, 3)}
    assert all(len(set(p)) == 3 for p, _ in neighbours(("out(1)", "out(3)", "out(4)"), 8))


def test_reference_draft_plan_identified_with_margin(llama_ref, llama_head, llama_draft):
    truth = _trained_plan(MODELS / "data" / "sample")
    assert truth == ("out(1)", "out(3)", "out(4)")
    ids = json.loads((DRAFT / "config.json").read_text())["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    r = identify_plan(llama_draft, llama_ref, llama_head, config_ids=ids)
    assert r.decision == "identified" and r.plan == truth, r.sentence()
    assert r.margin > 0 and r.margin_ci[0] > 0 and r.closest_ci[0] > 0
    assert r.best.loss < min(s.loss for s in r.scores[1:])
    assert r.best.accept_length is not None and 1.0 < r.best.accept_length <= 4.0
    assert "SpecForge out(i)" in r.config_reading
    assert PROVENANCE in r.sentence() and r.to_json()["provenance"] == PROVENANCE
    assert r.rows == sum(int(x.tokens.shape[0]) - x.start - 1 for x in llama_ref)


def _layer_offset_ids(n: int) -> list[list[int]]:
    """Every distinct config-id fault the fault generator draws for the Llama reference (``layer_offset``)."""
    out = []
    for seed in range(200):
        ids = faultgen.draw(seed, "layer_offset").params["ids"]
        if ids not in out:
            out.append(ids)
        if len(out) == n:
            break
    return out


@pytest.mark.parametrize("ids", _layer_offset_ids(3))
def test_wrong_config_ids_still_identify_the_trained_plan(llama_ref, llama_head, llama_draft, ids):
    """The checkpoint, not the config, decides: the config's ids replaced by a generated wiring fault's."""
    r = identify_plan(llama_draft, llama_ref, llama_head, config_ids=ids)
    assert r.decision == "identified" and r.plan == ("out(1)", "out(3)", "out(4)"), (ids, r.sentence())
    assert r.config_reading is None or "[1, 3, 4]" not in r.config_reading or ids == [1, 3, 4]


@pytest.mark.extended
@pytest.mark.parametrize("ids", _layer_offset_ids(40)[3:])
def test_every_generated_config_id_fault_identifies_the_trained_plan(llama_ref, llama_head, llama_draft, ids):
    r = identify_plan(llama_draft, llama_ref, llama_head, config_ids=ids)
    assert r.decision == "identified" and r.plan == ("out(1)", "out(3)", "out(4)"), (ids, r.sentence())


@pytest.mark.parametrize("ids", [[4, 5, 6], [1, 3, 4]])
def test_draft_trained_on_another_plan(llama_ref, llama_head, ids):
    """draft_alt was trained on out(4), out(5), out(6): found with its own ids, and from wrong ids [1, 3, 4] (no
    reading of which names it: the neighbourhood search walks there)."""
    truth = _trained_plan(MODELS / "data" / "sample_alt")
    assert truth == ("out(4)", "out(5)", "out(6)")
    r = identify_plan(Eagle3Draft.load(DRAFT_ALT, TARGET), llama_ref, llama_head, config_ids=ids)
    assert r.decision == "identified" and r.plan == truth, r.sentence()
    assert r.margin_ci[0] > 0
    if ids == [1, 3, 4]:
        assert r.rounds >= 1 and r.config_reading is None


def test_indistinguishable_plans_are_undecided(llama_ref, llama_head, llama_draft):
    """Where the reference holds the same tensor under two names (out(2) := out(3)), the plans differing only there
    score alike: undecided, no plan named."""
    refs = []
    for x in llama_ref:
        st = x.states.clone()
        st[:, x.names.index("out(2)")] = st[:, x.names.index("out(3)")]
        refs.append(LayerStates(x.key, x.tokens, x.start, x.names, st))
    cands = [Candidate(("out(1)", "out(3)", "out(4)"), ("a",)), Candidate(("out(1)", "out(2)", "out(4)"), ("b",)),
             Candidate(("out(4)", "out(3)", "out(1)"), ("c",))]
    r = identify_plan(llama_draft, refs, llama_head, cands, rounds=0)
    assert r.decision == "undecided" and r.plan is None
    assert {r.best.plan, r.runner_up.plan} == {cands[0].plan, cands[1].plan}
    assert r.margin == pytest.approx(0.0, abs=1e-9) and r.closest_ci[0] <= 0 <= r.closest_ci[1]
    assert "no plan is named" in r.sentence()


def test_reference_from_dump_reads_what_was_written(tmp_path, llama_ref):
    x = llama_ref[:2]
    samples = [{"key": s.key, "sample_id": s.key, "input_ids": s.tokens.tolist(), "num_prompt_tokens": s.start,
                "hidden": s.states.reshape(s.states.shape[0], -1)} for s in x]
    path = write_dump(tmp_path / "ref", samples, {"kind": "reference", "source": {"type": "hf"},
                                                  "layer_plan": {"tensors": list(x[0].names)}, "hidden_size": 128})
    back = reference_from_dump(path)
    assert [b.key for b in back] == [s.key for s in x] and [b.start for b in back] == [s.start for s in x]
    for b, s in zip(back, x):
        assert torch.equal(b.tokens, s.tokens) and torch.allclose(b.states, s.states)
        assert torch.equal(b.aux(["out(1)", "out(3)"]), torch.cat([s.states[:, 2], s.states[:, 4]], dim=-1))


@pytest.fixture(scope="module")
def kimi_ref():
    """16 held-out prompts x 64 sampled tokens (8 left the Llama-style draft undecided between out(0) and out(1) as
    its first chunk: +0.0044 [-0.0013, +0.0111] nats; 12 decided it, +0.0044 [+0.0014, +0.0073])."""
    return reference_from_hf(KIMI / "target", _prompts(KIMI / "target", 16), new_tokens=64, temperature=1.0, seed=0)


@pytest.mark.extended          # the Kimi target's HF continuations take ~2 min on 2 loaded cores
@pytest.mark.parametrize("draft", ["draft", "draft_mla"])
def test_kimi_drafts_plan_identified(kimi_ref, draft):
    truth = _trained_plan(KIMI / "data" / "sample")
    r = identify_plan(Eagle3Draft.load(KIMI / draft, KIMI / "target"), kimi_ref, TargetHead.load(KIMI / "target"),
                      config_ids=[2, 4, 5])                        # ids of another convention: the checkpoint decides
    assert r.decision == "identified" and r.plan == truth, r.sentence()
    assert r.margin_ci[0] > 0 and np.isfinite(r.best.loss)


def test_identified_plan_stands_in_for_the_training_data(tmp_path, llama_ref, llama_head, llama_draft):
    """The identified plan written as a training dump: the diagnosis reads its plan as ``identified`` (not a
    manifest's) with the provenance sentence, and its chunks are the reference's tensors of that plan; an undecided
    identification writes nothing."""
    from helpers.diagnosis.static import resolve_training_plan
    from helpers.draft.plan_id import write_plan_dump
    from helpers.formats.configs import read_target_config
    from helpers.formats.training_data import TrainingData

    r = identify_plan(llama_draft, llama_ref, llama_head, config_ids=[2, 4, 5])
    path = write_plan_dump(llama_ref, r, tmp_path)
    td = TrainingData(path, hidden_size=128)
    tp = resolve_training_plan(None, read_target_config(TARGET), training=td)
    assert tp.provenance == "identified" and tp.tensors == ["out(1)", "out(3)", "out(4)"]
    assert PROVENANCE in tp.source
    first = next(iter(td))
    assert torch.equal(first.load().float(), llama_ref[0].aux(r.plan).float())
    und = identify_plan(llama_draft, llama_ref[:2], llama_head,
                        [Candidate(("out(1)", "out(3)", "out(4)"), ("a",))] * 2, rounds=0)
    assert und.decision == "undecided"
    with pytest.raises(Exception, match="no identified layer plan"):
        write_plan_dump(llama_ref, und, tmp_path, name="und")


def test_batched_candidates_give_the_sequential_figures(llama_ref, llama_head, llama_draft, monkeypatch):
    """The candidate plans of a sequence stacked in one draft-extend pass (``batch``, the default) give bit for bit what
    one pass per candidate gives: every candidate's per-sequence loss and step-0 hits, the decision and margins, and
    every candidate's teacher-forced accept length; also when the batch is split into groups."""
    seq = identify_plan(llama_draft, llama_ref, llama_head, config_ids=[2, 4, 5], batch=False)
    bat = identify_plan(llama_draft, llama_ref, llama_head, config_ids=[2, 4, 5], batch=True)
    T = int(llama_ref[0].tokens.shape[0]) - 1
    assert len(plan_id._groups(len(seq.scores), T, llama_draft, True)) == 1          # one pass for every candidate
    assert [s.plan for s in bat.scores] == [s.plan for s in seq.scores] and len(seq.scores) >= 20
    for a, b in zip(seq.scores, bat.scores):
        assert np.array_equal(a.loss_sum, b.loss_sum) and np.array_equal(a.hits, b.hits), a.plan
        assert (a.loss, a.accept_length) == (b.loss, b.accept_length), a.plan
    assert (seq.decision, seq.plan, seq.margin_ci, seq.closest_ci) == (bat.decision, bat.plan, bat.margin_ci,
                                                                        bat.closest_ci)
    # every candidate's accept length (on 4 of the sequences), not only the best / runner-up / config readings the
    # identification reports
    plans, ref = [s.plan for s in seq.scores], llama_ref[:4]
    views = plan_id._views(llama_draft, ref, llama_head, 8)
    idx = np.random.default_rng(0).integers(0, len(ref), size=(200, len(ref)))
    one = plan_id._accept_lengths(llama_draft, ref, views, plans, 3, idx, batch=False)
    monkeypatch.setattr(plan_id, "BATCH_LOGITS", 7 * T * llama_draft.arch.draft_vocab)     # groups of 7
    assert [len(g) for g in plan_id._groups(len(plans), T, llama_draft, True)][:2] == [7, 7]
    many = plan_id._accept_lengths(llama_draft, ref, views, plans, 3, idx, batch=True)
    for p, x, y in zip(plans, one, many):
        assert x[0] == y[0] and np.array_equal(x[2], y[2]) and np.array_equal(x[3], y[3]), p
    # the plans' accept lengths differ (so their equality above compares distinct figures): a wrong chunk order
    # drafts worse than the trained plan
    al = {p: x[0] for p, x in zip(plans, one)}
    assert len(set(al.values())) > len(al) // 2, al
    assert al[("out(1)", "out(3)", "out(4)")] > al[("out(4)", "out(3)", "out(1)")] + 0.05, al


def test_memo_second_round_scores_only_the_new_sequences(llama_ref, llama_head, llama_draft, monkeypatch):
    """investigate's second round (twice the continuations) with the first round's memo: the same figures as without
    it, and the first sequences are not run through the draft again."""
    memo: dict = {}
    identify_plan(llama_draft, llama_ref[:4], llama_head, config_ids=[2, 4, 5], memo=memo)
    assert len(memo) >= 4 * 20
    runs = []
    real = plan_id._extends
    monkeypatch.setattr(plan_id, "_extends", lambda d, r, plans, b: (runs.append((r.key, len(plans))),
                                                                      real(d, r, plans, b))[1])
    again = identify_plan(llama_draft, llama_ref, llama_head, config_ids=[2, 4, 5], memo=memo)
    scored = {k for k, n in runs if n > 3}                 # the scoring passes (accept lengths: <= 3 plans)
    assert scored == {x.key for x in llama_ref[4:]}, runs
    monkeypatch.setattr(plan_id, "_extends", real)
    fresh = identify_plan(llama_draft, llama_ref, llama_head, config_ids=[2, 4, 5])
    assert [s.plan for s in again.scores] == [s.plan for s in fresh.scores]
    for a, b in zip(again.scores, fresh.scores):
        assert np.array_equal(a.loss_sum, b.loss_sum) and np.array_equal(a.hits, b.hits), a.plan
    assert (again.decision, again.plan, again.margin_ci) == (fresh.decision, fresh.plan, fresh.margin_ci)


def test_identified_plan_dump_feeds_the_draft_stage_its_continuation_rows(tmp_path, llama_ref, llama_head,
                                                                          llama_draft):
    """The stand-in for withheld training data reaches the draft stage with a loss mask on its continuation (the
    rows the identification scored): before, a project dump carried none and every row was left out ("no
    loss-masked continuation", 0 rows teacher-forced)."""
    from helpers.draft.draft_stage import draft_rows
    from helpers.draft.plan_id import write_plan_dump
    from helpers.draft.teacher_forced import reduce

    r = identify_plan(llama_draft, llama_ref, llama_head, config_ids=[2, 4, 5])
    path = write_plan_dump(llama_ref, r, tmp_path)
    said: list = []
    dr = draft_rows(llama_draft, draft_dir=DRAFT, target_dir=TARGET, training=path, hidden_size=128, log=None,
                    log_path=None, progress=said.append)
    assert not [s for s in said if "left out" in s]
    assert [s.key for s in dr["seqs"]] == [x.key for x in llama_ref]
    for s, x in zip(dr["seqs"], llama_ref):
        want = (torch.arange(int(x.tokens.shape[0])) >= x.start).long()
        assert torch.equal(torch.as_tensor(s.loss_mask).long(), want)
    res = reduce(dr["rows"], "specforge", dr["steps"], labels=dr["labels"])
    # SpecForge zeroes a sample's last mask entry: T - start - 1 step-0 rows each, the rows the identification scored
    assert res.rows == r.rows == sum(int(x.tokens.shape[0]) - x.start - 1 for x in llama_ref)
    assert 0.0 < res.acc[0] <= 1.0
