"""The EAGLE-1 draft's investigation stages (helpers/investigation/single_state.py EAGLE1 through
helpers/investigation/mtp.py; helpers/draft/eagle1_stage.py) on real tensors: the trained EAGLE-1 draft
(env/models/llama_h64/draft_eagle1) on its committed held-out rows (the target's sampled sequences with its
post-final-norm states), the generated faults of tests/support/eagle1_faults.py, and an HF every-layer reference of
two of those sequences for the served-state identification. No server."""
from __future__ import annotations

import json

import pytest
import torch

from helpers.capture import capture_reference_hf
from helpers.draft.eagle1_stage import eagle1_draft_stage
from helpers.draft.loader import load_draft
from helpers.draft.model import target_final_norm, target_lm_head
from helpers.draft.simulate import DraftSettings, SimSequence, simulate_sequences
from helpers.formats.dumps import read_dump
from helpers.formats.training_data import TrainingData
from helpers.investigation.mtp import POST_NORM, budget_sentence, identify_state, mtp_budget, state_findings
from helpers.investigation.single_state import EAGLE1
from helpers.records import InvestigationDoc
from helpers.views.draft_kind import draft_kind
from support.eagle1_faults import DRAFT, TARGET, Eagle1Fault, draw, residual_missing, write_faulty_draft

ROWS = DRAFT / "validation"


@pytest.fixture(scope="module")
def head():
    return load_draft(DRAFT, TARGET)


@pytest.fixture(scope="module")
def sequences():
    """8 held-out sequences as drafting chains: tokens, the post-norm states, the prompt the first 16 tokens, and
    the target's own argmax at each position (the rows are sampled, not greedy)."""
    lm_head, _ = target_lm_head(TARGET)
    out = []
    for s in TrainingData(ROWS, hidden_size=128, max_samples=8):
        h = s.meta["final_hidden"].float()
        toks = torch.as_tensor(s.input_ids, dtype=torch.long)
        tgt = torch.cat([toks[:1], (h[:-1] @ lm_head.float().T).argmax(-1)])
        out.append(SimSequence(s.key, toks, h, 16, targets=tgt))
    return out


def test_draft_stage_reproduces_the_log_on_its_own_rows(head):
    # 15 s at load 20 on 2 cores: 32 x 113 rows teacher-forced
    log = json.loads((DRAFT / "training_log.json").read_text())
    r = eagle1_draft_stage(head, TARGET, 3, draft_dir=DRAFT)
    assert r["same_rows"] and r["log_steps"] == 1 and r["log"].endswith("draft_eagle1/training_log.json")
    row = r["stage"]["table"][0]
    assert abs(row["acc"] - log["val_final"]["acc"]) < 0.005      # bf16 checkpoint vs the trainer's float weights
    assert r["stage"]["trainer"].startswith("env/models/train_eagle1.py")
    assert r["loss"]["decision"] == "clear" and abs(r["loss"]["delta"]) < 0.01


def test_no_log_is_undecided_and_the_target_log_is_never_read(head, tmp_path):
    folder = write_faulty_draft(Eagle1Fault(0, "fc_scale", {"half": "embed", "factor": 1.0}), tmp_path / "d")
    (folder / "training_log.json").unlink()
    r = eagle1_draft_stage(head, TARGET, 3, draft_dir=folder)        # the target folder holds a training_log.json
    assert r["log"] is None and r["loss"]["decision"] == "undecided"
    assert "the EAGLE-1 draft" in r["loss"]["why"] and "training_log.json" in r["loss"]["why"]


@pytest.mark.parametrize("fault", [Eagle1Fault(1, "fc_swap"),
                                   Eagle1Fault(2, "fc_scale", {"half": "hidden", "factor": 8.0})])
def test_checkpoint_faults_count_in_the_draft_stage(fault, tmp_path):
    folder = write_faulty_draft(fault, tmp_path / "d")
    r = eagle1_draft_stage(load_draft(folder, TARGET), TARGET, 3, draft_dir=folder, max_rows=8)
    assert r["same_rows"]                                             # the log points at the committed rows
    assert r["loss"]["decision"] == "counts" and r["loss"]["delta"] > r["loss"]["threshold"]


def test_draw_is_seeded_and_strengths_in_range():
    assert draw(7).to_json() == draw(7).to_json()
    kinds = {draw(s).kind for s in range(40)}
    assert {"clean", "fc_swap", "fc_scale", "residual_missing", "pre_norm"} <= kinds
    for s in range(40):
        f = draw(s)
        if f.kind == "fc_scale":
            assert 1 / 16 <= f.params["factor"] <= 1 / 2 or 2 <= f.params["factor"] <= 16


def test_residual_missing_counts_at_the_engine_stage(head, sequences):
    st = DraftSettings(3, 1, 4)
    n_new = max(len(s.tokens) - s.start for s in sequences)
    live = simulate_sequences(residual_missing(head), sequences, [st], max_new_tokens=n_new)["per_request"][st]
    b = mtp_budget(head, sequences, sequences, live, st, max_new_tokens=n_new, draft=None, profile=EAGLE1)
    assert b["kind"] == "eagle1" and b["settings_check"] is None     # no trained-depth check for EAGLE-1
    assert b["losses"]["wiring"]["delta"] == 0.0
    assert b["losses"]["engine"]["decision"] == "counts" and b["cause"] == "engine"
    assert budget_sentence(b).startswith("EAGLE-1 accept length")
    assert "vLLM" in b["stages"][-1]["source"]


@pytest.fixture(scope="module")
def reference(sequences, tmp_path_factory):
    """HF every-layer reference of two held-out sequences (embedding, out(0) .. out(7))."""
    seqs = sequences[:2]
    ref = capture_reference_hf(TARGET, [{"id": s.key, "input_ids": s.tokens.tolist()} for s in seqs],
                               tmp_path_factory.mktemp("ref"), progress=False)
    return seqs, ref


def test_served_state_identified_and_pre_norm_named(reference):
    seqs, ref = reference
    w, eps = target_final_norm(TARGET)
    ok = identify_state(seqs, ref, w, eps)                           # the rows' post-norm states, as vLLM feeds
    assert ok["matches"] and ok["best"] == POST_NORM and ok["best_rel_error"] < 1e-3
    assert state_findings(ok, None, EAGLE1) == []
    src = read_dump(ref)
    i = src.layer_plan["tensors"].index("out(7)")
    by = {s.sample_id: s.load() for s in src.samples}
    pre = [SimSequence(s.key, s.tokens, by[s.key][:, i * 128:(i + 1) * 128].float(), s.start) for s in seqs]
    bad = identify_state(pre, ref, w, eps)
    bad.update(engine=EAGLE1.engine)
    f = state_findings(bad, None, EAGLE1)
    assert bad["identified"] == "out(7)" and bad["rel_error"][POST_NORM] > 0.1
    assert [x["kind"] for x in f] == ["norm_mismatch"]
    assert "the EAGLE-1 draft" in f[0]["detail"] and "vLLM feeds it after the final norm" in f[0]["detail"]


def test_page_kind_of_an_eagle1_run():
    doc = InvestigationDoc(url="http://127.0.0.1:1", run_dir="/tmp/x")
    doc.diagnosis = {"kind": "eagle1", "served_state": None}
    k = draft_kind(doc)
    assert k.title == "EAGLE-1 draft live investigation" and k.single_state and not k.mtp
    assert draft_kind(budget={"kind": "eagle1"}).stage_order[0] == "checkpoint (teacher-forced)"
