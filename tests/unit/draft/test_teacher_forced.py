"""helpers.draft.teacher_forced: the checkpoint measured as its trainer measured it.

The project's trainer (env/models/e3f_models/draft.py::ttt_loss) is run on the same rows as an independent
implementation: the per-step accuracy and loss must be the trainer's own numbers. Each trainer's definition (which rows
count, what counts as right) is checked on rows whose right and wrong answers are set by hand, and the metric must
see the faults a log cannot: a damaged checkpoint and a wrong d2t lose accuracy at every step."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers.draft import teacher_forced as tf
from helpers.draft.model import Eagle3Draft, target_lm_head
from helpers.errors import BadInput
from helpers.formats.training_data import TrainingData
from helpers.paths import REFERENCE_DRAFT, REFERENCE_TARGET, REFERENCE_TRAINING
from support import ROOT, import_from
from support.drafts import damaged_draft, wrong_d2t_draft

MODELS = ROOT / "env" / "models"


@pytest.fixture(scope="module")
def head():
    return target_lm_head(REFERENCE_TARGET)[0]


@pytest.fixture(scope="module")
def seqs(head):
    return tf.tf_sequences(TrainingData(REFERENCE_TRAINING, hidden_size=128), head)


@pytest.fixture(scope="module")
def rows(seqs):
    return tf.run(Eagle3Draft.load(REFERENCE_DRAFT, REFERENCE_TARGET), seqs, 4)


def test_e3f_metric_is_the_trainers_own(rows, head):
    """Per-step accuracy and loss over every loss-masked row equal ttt_loss's on the same samples (one sample per
    batch, the counts pooled)."""
    import_from(MODELS, "e3f_models")
    ref = import_from(MODELS, "eval_draft_faults").load_draft(REFERENCE_DRAFT, REFERENCE_TARGET)[0]
    from e3f_models.draft import ttt_loss
    acc_n, acc_d, loss_n, loss_d = (np.zeros(4) for _ in range(4))
    for s in TrainingData(REFERENCE_TRAINING, hidden_size=128):
        m = torch.as_tensor(np.asarray(s.meta["loss_mask"]))[None].clone()
        m[0, -1] = 0
        batch = {"input_ids": torch.as_tensor(np.asarray(s.input_ids))[None], "loss_mask": m,
                 "aux_hidden_state": s.load()[None].float(), "hidden_state": s.meta["final_hidden"][None].float()}
        with torch.no_grad():
            _, met = ttt_loss(ref, batch, head, 4)
        tl = (s.meta["final_hidden"].float() @ head.float().T)
        arg = torch.cat([tl[1:].argmax(-1), torch.zeros(1, dtype=torch.long)])
        ref_t2d = ref.t2d.cpu()
        for k in range(4):
            mk = torch.cat([m[0, k:], torch.zeros(k, dtype=m.dtype)]).float()
            pm = mk * torch.cat([ref_t2d[arg][k:].float(), torch.zeros(k)])
            acc_n[k] += met["acc"][k] * float(mk.sum())
            acc_d[k] += float(mk.sum())
            loss_n[k] += met["loss"][k] * float(pm.sum())
            loss_d[k] += float(pm.sum())
    got = tf.reduce(rows, "e3f", 4)
    np.testing.assert_allclose(got.acc, acc_n / acc_d, atol=1e-6)
    np.testing.assert_allclose(got.loss, loss_n / loss_d, rtol=1e-4)
    assert got.rows == int(acc_d[0]) and got.labels == "target"


def _rows(hit_full, hit_restr, invocab, loss_mask):
    T = len(loss_mask)
    ce = [np.ones(len(h)) for h in hit_full]
    return tf.SeqRows("s", T, np.asarray(loss_mask), [np.asarray(h, bool) for h in hit_full],
                      [np.asarray(h, bool) for h in hit_restr], [np.asarray(v, bool) for v in invocab], ce)


def test_each_trainers_rows_and_right_answers():
    """Seven tokens, the continuation from token 3: rows t of step k score position t+1+k. SpecForge counts rows with
    loss_mask[t+k] (the last entry zeroed) and an out-of-vocabulary target as wrong; TorchSpec leaves it out; EAGLE
    equals SpecForge; speculators count rows with loss_mask[t+1+k] and chain the steps."""
    lm = [0, 0, 0, 1, 1, 1, 1]
    # step 0: rows 0..5 score positions 1..6; step 1: rows 0..4 score positions 2..6
    full = [[0, 0, 1, 1, 0, 1], [0, 1, 1, 1, 1]]
    restr = [[0, 0, 1, 1, 1, 1], [0, 1, 1, 0, 1]]
    inv = [[1, 1, 1, 1, 0, 1], [1, 1, 1, 1, 0]]
    r = _rows(full, restr, inv, lm)
    sf = tf.reduce([r], "specforge", 2)
    # specforge step 0: rows t with m[t] (m = [0,0,0,1,1,1,0]) -> t = 3, 4, 5: full hits 1, 0, 1
    assert sf.acc_den[0][0] == 3 and sf.acc_num[0][0] == 2
    # step 1: rows t with m[t+1] -> t = 2, 3, 4: full hits 1, 1, 1
    assert sf.acc_den[0][1] == 3 and sf.acc_num[0][1] == 3
    ts = tf.reduce([r], "torchspec", 2)
    # torchspec step 0: position_mask = m[t] & invocab: t = 3, 5 (t = 4 out of vocabulary): restr hits 1, 1
    assert ts.acc_den[0][0] == 2 and ts.acc_num[0][0] == 2
    eg = tf.reduce([r], "eagle", 2)
    assert eg.acc_den[0][0] == 3 and eg.acc_num[0][0] == 2      # restr hit on an OOV row does not count
    sp = tf.reduce([r], "speculators", 2)
    # speculators step 0: rows t with lm[t+1]: t = 2..5: restr hits 1, 1, 1, 1 -> 4 / 4
    assert sp.acc_den[0][0] == 4 and sp.acc_num[0][0] == 4
    # step 1: rows t < 5 with lm[t+2]: t = 1..4, chained with step 0 (prev = lm[t+1] & hit0): t = 2, 3, 4 alive;
    # step-1 restr hits at t = 2, 3, 4: 1, 0, 1 -> 2 of the 4 masked rows; cond: 2 of the 3 rows right through step 0
    assert sp.acc_den[0][1] == 4 and sp.acc_num[0][1] == 2 and sp.cond[1] == pytest.approx(2 / 3)
    assert sp.kind == "joint" and sf.kind == "marginal"


def test_accept_length_formula_and_its_ci(rows):
    res = tf.reduce(rows, "e3f", 4)
    idx = tf.bootstrap_index(len(rows))
    al, lo, hi, draws = tf.accept_length_ci(res, 3, idx)
    a = res.acc
    assert al == pytest.approx(1 + a[0] + a[0] * a[1] + a[0] * a[1] * a[2])
    assert lo <= al <= hi and draws.shape == (idx.shape[0],)
    assert tf.chain_accept_length([0.5, 0.4], "joint", 2) == pytest.approx(1.9)


def test_damaged_checkpoint_and_wrong_d2t_lose_accuracy_at_every_step(rows, seqs, tmp_path):
    clean = tf.reduce(rows, "e3f", 4)
    for d in (damaged_draft(tmp_path / "dam", noise=2.0), wrong_d2t_draft(tmp_path / "d2t")):
        bad = tf.reduce(tf.run(Eagle3Draft.load(d, REFERENCE_TARGET), seqs, 4), "e3f", 4)
        for k in range(4):
            assert bad.acc[k] < clean.acc[k] - 0.1, (d.name, k, bad.acc, clean.acc)


def test_rows_without_a_target_distribution_fall_back_to_recorded_tokens(seqs):
    s = seqs[0]
    r = tf.run_sequence(Eagle3Draft.load(REFERENCE_DRAFT, REFERENCE_TARGET),
                        tf.TFSequence(s.key, s.input_ids, s.loss_mask, s.aux), 2)
    assert r.ce[0] is None
    res = tf.reduce([r], "e3f", 2, labels="recorded")
    assert res.loss is None and res.labels == "recorded" and 0 < res.acc[0] <= 1
    with pytest.raises(BadInput, match="final hidden states"):
        tf.run_sequence(Eagle3Draft.load(REFERENCE_DRAFT, REFERENCE_TARGET),
                        tf.TFSequence(s.key, s.input_ids, s.loss_mask, s.aux, torch.zeros(3, 5), torch.zeros(7, 5)), 2)
    with pytest.raises(BadInput, match="unknown trainer"):
        tf.reduce([r], "nope", 2)


def test_draft_without_d2t_reads_its_ids_as_the_first_target_ids(seqs, tmp_path):
    """No d2t over a draft vocabulary smaller than the target's: SGLang keeps hot_token_id None, so draft id i is
    target id i; the trainers' restricted distribution is then over target ids [0, draft_vocab) (a draft that lost
    its d2t loses accuracy, and the pass does not break on the width mismatch)."""
    from safetensors.torch import load_file, save_file
    import json
    import shutil
    d = tmp_path / "nod2t"
    shutil.copytree(REFERENCE_DRAFT, d)
    for f in d.glob("*.safetensors"):
        t = load_file(f)
        save_file({k: v for k, v in t.items() if k not in ("d2t", "t2d")}, f)
    draft = Eagle3Draft.load(d, REFERENCE_TARGET)
    assert draft.hot_token_id is None and draft.arch.draft_vocab < draft.arch.vocab
    s = seqs[0]
    r = tf.run_sequence(draft, s, 2)
    assert r.ce[0] is not None and r.ce[0].shape == r.hit_restr[0].shape
    bad = tf.reduce([r], "e3f", 2)
    good = tf.reduce([tf.run_sequence(Eagle3Draft.load(REFERENCE_DRAFT, REFERENCE_TARGET), s, 2)], "e3f", 2)
    assert bad.acc[0] < good.acc[0] - 0.1 and bad.loss[0] > good.loss[0], (bad.acc, good.acc, bad.loss, good.loss)
    assert json.loads((d / "config.json").read_text())["draft_vocab_size"] == draft.arch.draft_vocab
