"""The NextN head's draft stage (helpers/draft/nextn_stage.py) on real tensors: the Kimi-class target's trained head
(env/models/kimi/target, layer 8) teacher-forced on the committed validation rows against its
nextn_training_log.json, and generated faults (tests/support/mtp_faults.py) written into a copy of the target."""
from __future__ import annotations

import json
from itertools import count
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers.draft.loader import load_draft
from helpers.draft.nextn_stage import NEXTN_LOG, find_nextn_log, nextn_draft_stage, relocated_rows, steps_check
from helpers.errors import BadInput
from support import ROOT
from support.mtp_faults import CLASSES, TARGET, VALIDATION, damage, draw, write_faulty_target

SAMPLE = ROOT / "env" / "models" / "kimi" / "data" / "sample"


@pytest.fixture(scope="module")
def log():
    p = TARGET / NEXTN_LOG
    if not p.is_file() or not VALIDATION.is_dir():
        pytest.skip("the Kimi-class target's NextN head or its validation rows are not built here")
    return json.loads(p.read_text())


@pytest.fixture(scope="module")
def clean(log):
    return load_draft(TARGET, TARGET)


@pytest.fixture(scope="module")
def staged(clean):
    """The clean head's draft stage served at 1 and at 3 steps (each a 3-step teacher-forced pass: the log's)."""
    return {steps: nextn_draft_stage(clean, TARGET, steps, validation=VALIDATION) for steps in (1, 3)}


def test_clean_head_is_cleared_against_its_log_on_the_log_rows(log, staged):
    """The committed rows are the log's validation_rows: the head as served reproduces the log's per-step accuracy
    (pooled here, mean per batch of 32 in the trainer: within 0.01) and the CI rules a material loss out at 1 and 3
    steps."""
    for steps, r in staged.items():
        st, loss = r["stage"], r["loss"]
        assert r["same_rows"] and r["trained_steps"] == 1 and r["log_steps"] == 3
        for row, want in zip(st["table"], log["validation_rows"]["acc_per_step"]):
            assert row["log_acc"] == want and abs(row["acc"] - want) < 0.01
        assert loss["decision"] == "clear" and loss["ci"][1] < loss["threshold"]
        assert abs(loss["delta"]) < 0.03 and st["comparable"]


def test_rows_other_than_the_logs_never_count(log, clean):
    """The 16 greedy sample rows are not the log's rows: the log's own split figure (val_final, on its corpus rows)
    is compared, the stage says the rows differ, and whatever the loss it is not counted."""
    r = nextn_draft_stage(clean, TARGET, 1, validation=SAMPLE)
    assert not r["same_rows"] and "not on" in r["why_rows"]
    assert r["stage"]["log_accept_length"] == pytest.approx(1 + log["val_final"]["acc_per_step"][0])
    assert r["loss"]["decision"] != "counts"


def test_where_the_log_is_read_from(tmp_path, log):
    """--training-log > the --training folder (or its parent) > the NextN checkpoint folder > the target folder."""
    tgt, draft, data = tmp_path / "t", tmp_path / "d", tmp_path / "train" / "rows"
    for d in (tgt, draft, data):
        d.mkdir(parents=True)
    assert find_nextn_log(tgt) is None
    for d in (tgt, draft, data.parent):
        (d / NEXTN_LOG).write_text("{}")
    assert find_nextn_log(tgt) == tgt / NEXTN_LOG
    assert find_nextn_log(tgt, draft_dir=draft) == draft / NEXTN_LOG
    assert find_nextn_log(tgt, draft_dir=draft, training=data) == data.parent / NEXTN_LOG
    assert find_nextn_log(tgt, given=TARGET / NEXTN_LOG) == TARGET / NEXTN_LOG
    with pytest.raises(BadInput, match="--training-log"):
        find_nextn_log(tgt, given=tmp_path / "none.json")
    # the log's validation_rows.path was written in another checkout: the same data set is found in this one
    rec = Path(log["validation_rows"]["path"])
    assert relocated_rows(log, TARGET / NEXTN_LOG).resolve() == (rec if rec.is_dir() else VALIDATION).resolve()
    moved = {"validation_rows": {"path": "/elsewhere/x/y/nowhere"}}
    assert relocated_rows(moved, TARGET / NEXTN_LOG) is None and relocated_rows({}, TARGET / NEXTN_LOG) is None



def test_no_log_is_undecided_saying_where_it_was_looked_for(tmp_path, clean):
    r = nextn_draft_stage(clean, tmp_path, 1, validation=VALIDATION)
    assert r["log"] is None and r["loss"]["decision"] == "undecided"
    assert NEXTN_LOG in r["loss"]["why"] and "--training-log" in r["loss"]["why"]


def test_steps_beyond_the_trained_depth_are_named_with_their_accuracy(log, staged):
    r = staged[3]
    assert steps_check(1, r["trained_steps"], r["stage"]) is None
    sc = steps_check(3, r["trained_steps"], r["stage"])
    assert sc["trained_steps"] == 1 and [u["step"] for u in sc["untrained"]] == [1, 2]
    assert [u["log_acc"] for u in sc["untrained"]] == log["validation_rows"]["acc_per_step"][1:]


def test_generator_draws_and_damages_only_the_head(tmp_path):
    """Seeded draws are reproducible and cover every class; each checkpoint fault changes only layer 8's tensors,
    as it says (the swap exchanges the halves exactly, the scale multiplies one half by its factor)."""
    fs = [draw(s) for s in range(40)]
    assert [f.label() for f in fs] == [draw(s).label() for s in range(40)]
    assert {f.kind for f in fs} == set(CLASSES)
    w0 = load_file(str(TARGET / "model.safetensors"))
    eh = "model.layers.8.eh_proj.weight"
    for kind in ("eh_swap", "eh_scale", "head_noise"):
        f = fs[next(i for i in count() if fs[i].kind == kind)]
        w = dict(w0)
        changed = damage(w, f, 8)
        assert changed and all(k.startswith("model.layers.8.") for k in changed)
        assert all(torch.equal(w[k], w0[k]) for k in w0 if k not in changed)
        H = w0[eh].shape[1] // 2
        if kind == "eh_swap":
            assert torch.equal(w[eh][:, :H], w0[eh][:, H:]) and torch.equal(w[eh][:, H:], w0[eh][:, :H])
        if kind == "eh_scale":
            sl = slice(0, H) if f.params["half"] == "embed" else slice(H, 2 * H)
            other = slice(H, 2 * H) if f.params["half"] == "embed" else slice(0, H)
            torch.testing.assert_close(w[eh][:, sl].float(), (w0[eh][:, sl].float() * f.params["factor"]).to(
                w0[eh].dtype).float())
            assert torch.equal(w[eh][:, other], w0[eh][:, other])


def test_first_drawn_swap_is_named_in_the_draft_stage(tmp_path, log):
    """The first seed that draws ``eh_swap``: its head, written to a copy of the target, is named in the draft stage
    (a material loss beyond the CI against the log, on the log's own rows)."""
    f = draw(next(s for s in count() if draw(s).kind == "eh_swap"))
    folder = write_faulty_target(f, tmp_path / "t")
    r = nextn_draft_stage(load_draft(folder, folder), folder, 1, validation=VALIDATION)
    loss = r["loss"]
    assert r["same_rows"] and loss["decision"] == "counts"
    assert loss["ci"][0] > 0 and loss["delta"] >= loss["threshold"]


@pytest.mark.parametrize("value", [float("inf"), "1", True, 0, 1.0, [1]])
def test_a_train_steps_other_than_an_int_from_1_is_refused_naming_the_log(tmp_path, log, clean, value):
    """hyper.train_steps is the trained chain depth (an int >= 1, env/models/train_nextn.py writes it): Infinity
    crashed with OverflowError, the string "1" was dropped and the stage cleared the head as if the log said nothing.
    Now one BadInput naming the log and the field, before any row is run; a log without it still says nothing."""
    from helpers.draft.nextn_stage import trained_steps
    bad = tmp_path / NEXTN_LOG
    bad.write_text(json.dumps({**log, "hyper": {**log["hyper"], "train_steps": value}}))
    with pytest.raises(BadInput) as e:
        nextn_draft_stage(clean, TARGET, 1, training_log=bad, validation=VALIDATION)
    assert str(e.value).startswith(f"{bad} [hyper.train_steps]: expected an integer >= 1") and "\n" not in str(e.value)
    assert trained_steps(log, bad) == log["hyper"]["train_steps"] == 1
    assert trained_steps({"hyper": {}}, bad) is None and trained_steps({}, bad) is None


def test_a_token_id_past_the_targets_vocabulary_is_refused_naming_row_file_and_vocab(tmp_path, clean):
    """A validation row holding input_ids[4] = 10**6 (vocab 4096) crashed with IndexError in the head's embedding
    (Eagle3Draft.extend_many); the draft stages' one row reader (helpers.draft.teacher_forced.tf_sequences) refuses
    it naming the file, input_ids and the target's vocabulary (its lm_head rows)."""
    import shutil
    from helpers.draft.model import target_lm_head
    rows = tmp_path / "validation"
    shutil.copytree(VALIDATION, rows)
    f = sorted((rows / "rows_0-2000").glob("data_*.ckpt"))[3]
    x = torch.load(f, weights_only=True)
    V = int(target_lm_head(TARGET)[0].shape[0])
    assert int(x["input_ids"].max()) < V
    x["input_ids"][4] = 10 ** 6
    torch.save(x, f)
    with pytest.raises(BadInput) as e:
        nextn_draft_stage(clean, TARGET, 1, validation=rows)
    assert str(e.value) == (f"{f} [input_ids]: token id 1000000 at row 4 is past the target's vocabulary ({V} ids: "
                            "its lm_head rows)")
