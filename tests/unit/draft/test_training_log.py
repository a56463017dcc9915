"""helpers.draft.training_log: each trainer's log format read into per-position accuracies, and the accept length
they predict (bonus token included, cut at the number of draft steps)."""
from __future__ import annotations

import json
import math

import pytest

from helpers.draft.training_log import predicted_accept_length, read_training_log
from helpers.errors import BadInput
from helpers.paths import REFERENCE_DRAFT


def _al(p_ge):
    return 1.0 + sum(p_ge)


def _prods(a):
    out, p = [], 1.0
    for x in a:
        p *= x
        out.append(p)
    return out


def test_ours_reference_log_matches_its_own_proxy():
    path = REFERENCE_DRAFT / "training_log.json"
    doc = json.loads(path.read_text())
    acc = doc["val_final"]["acc_per_step"]
    log = read_training_log(path)
    assert (log.format, log.kind, log.split) == ("e3f", "marginal", "val")
    assert log.per_position == acc
    out = predicted_accept_length(log, 3)
    # 1 + a1 + a1 a2 + a1 a2 a3 with the file's val_final accuracies
    assert out["accept_length"] == pytest.approx(1 + acc[0] + acc[0] * acc[1] + acc[0] * acc[1] * acc[2], abs=1e-12)
    assert out["accept_length"] == pytest.approx(2.2228, abs=1e-4)
    assert out["accept_length"] == pytest.approx(doc["val_final"]["proxy_accept_length_3_steps"], abs=1e-9)
    assert log.reported_key == "val_final/proxy_accept_length_3_steps" and log.reported_includes_bonus is True
    assert out["complete"] and out["positions_used"] == 3 and "independence" in out["note"]


def test_specforge_wandb_summary_prefers_eval_and_reads_simulated_acc_len_without_bonus(tmp_path):
    ev, tr = [0.8, 0.7, 0.6, 0.5], [0.9, 0.85, 0.8, 0.75]
    m = {f"eval/acc_{i}": v for i, v in enumerate(ev)} | {f"train/acc_{i}": v for i, v in enumerate(tr)}
    m |= {"train/lr": 1e-4, "eval/ploss_0": 1.2, "eval/simulated_acc_len": sum(_prods(ev))}
    f = tmp_path / "wandb-summary.json"
    f.write_text(json.dumps(m))
    log = read_training_log(f)
    assert (log.format, log.kind, log.split) == ("specforge", "marginal", "eval")
    assert log.per_position == ev and log.source_keys == [f"eval/acc_{i}" for i in range(4)]
    assert log.reported_key == "eval/simulated_acc_len" and log.reported_includes_bonus is False
    out = predicted_accept_length(log, 3)
    assert out["accept_length"] == pytest.approx(1 + 0.8 + 0.8 * 0.7 + 0.8 * 0.7 * 0.6)
    assert out["p_accept_ge"] == pytest.approx([0.8, 0.56, 0.336])


def test_specforge_history_takes_the_last_entry_with_eval_keys(tmp_path):
    hist = [{"train/acc_0": 0.5, "train/acc_1": 0.4, "_step": 10},
            {"eval/acc_0": 0.55, "eval/acc_1": 0.45, "_step": 10},
            {"train/acc_0": 0.7, "train/acc_1": 0.6, "_step": 20},
            {"eval/acc_0": 0.72, "eval/acc_1": 0.61, "_step": 20},
            {"train/acc_0": 0.75, "train/acc_1": 0.65, "_step": 30}]
    f = tmp_path / "history.json"
    f.write_text(json.dumps(hist))
    log = read_training_log(f)
    assert log.entry == 3 and log.split == "eval" and log.per_position == [0.72, 0.61]
    assert predicted_accept_length(log, 2)["accept_length"] == pytest.approx(1 + 0.72 + 0.72 * 0.61)
    # a history with training keys only: the last training entry, and a note that no validation was logged
    g = tmp_path / "train_only.jsonl"
    g.write_text("\n".join(json.dumps(e) for e in hist if "train/acc_0" in e))
    log = read_training_log(g)
    assert log.entry == 2 and log.split == "train" and log.per_position == [0.75, 0.65]
    assert any("no validation" in n for n in log.notes)


def test_torchspec_per_position_list_jsonl(tmp_path):
    pp = [0.66, 0.58, 0.5]
    lines = [{"train/avg_loss": 3.0, "train/avg_acc": 0.5, "step": 1},
             {"eval/avg_loss": 2.5, "eval/avg_acc": pp[0], "eval/per_position_acc": pp,
              "eval/simulated_acc_len": sum(_prods(pp)), "step": 2}]
    f = tmp_path / "metrics.jsonl"
    f.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    log = read_training_log(f)
    assert (log.format, log.kind, log.split, log.entry) == ("torchspec", "marginal", "eval", 1)
    assert log.per_position == pp and log.reported_includes_bonus is False
    out = predicted_accept_length(log, 3)
    assert out["accept_length"] == pytest.approx(_al(_prods(pp)))


def test_speculators_joint_read_directly_and_conditional_multiplied(tmp_path):
    full, cond = [0.7, 0.45, 0.27], [0.7, 0.6428571, 0.6]
    m = {f"val/full_acc_{k}": v for k, v in enumerate(full)} | {f"val/cond_acc_{k}": v for k, v in enumerate(cond)}
    m |= {f"train/full_acc_{k}": v + 0.05 for k, v in enumerate(full)}
    f = tmp_path / "speculators.json"
    f.write_text(json.dumps(m))
    log = read_training_log(f)
    assert (log.format, log.kind, log.split) == ("speculators", "joint", "val")
    out = predicted_accept_length(log, 3)
    assert out["p_accept_ge"] == pytest.approx(full)
    assert out["accept_length"] == pytest.approx(1 + 0.7 + 0.45 + 0.27)
    # conditional only: P(N >= k) is the running product
    g = tmp_path / "cond.json"
    g.write_text(json.dumps({f"val/cond_acc_{k}": v for k, v in enumerate(cond)}))
    log = read_training_log(g)
    assert log.kind == "conditional"
    out = predicted_accept_length(log, 3)
    assert out["p_accept_ge"] == pytest.approx(_prods(cond))
    assert out["accept_length"] == pytest.approx(1 + 0.7 + 0.7 * 0.6428571 + 0.7 * 0.6428571 * 0.6)


def test_speculators_sum_total_accumulators(tmp_path):
    m = {"full_acc_0_sum": 70.0, "full_acc_0_total": 100.0, "full_acc_1_sum": 42.0, "full_acc_1_total": 100.0,
         "cond_acc_0_sum": 70.0, "cond_acc_0_total": 100.0}
    f = tmp_path / "acc.json"
    f.write_text(json.dumps(m))
    log = read_training_log(f)
    assert (log.format, log.kind) == ("speculators", "joint") and log.per_position == pytest.approx([0.7, 0.42])
    assert predicted_accept_length(log, 2)["accept_length"] == pytest.approx(2.12)


def test_eagle_text_log_uses_the_last_test_epoch(tmp_path):
    text = "\n".join([
        "Now training epoch 0",
        "Train Epoch [1/2], position 0,  Acc: 0.50", "Train Epoch [1/2], position 1,  Acc: 0.40",
        "Train Epoch [1/2], position 0, pLoss: 2.10",
        "Test Epoch [1/2], position 0,  Acc: 0.52", "Test Epoch [1/2], position 1,  Acc: 0.41",
        "Train Epoch [2/2], position 0,  Acc: 0.71", "Train Epoch [2/2], position 1,  Acc: 0.62",
        "Test Epoch [2/2], position 0,  Acc: 0.69", "Test Epoch [2/2], position 1,  Acc: 0.60",
        "Test Epoch [2/2], position 1, pLoss: 1.50",
    ])
    f = tmp_path / "train.log"
    f.write_text(text)
    log = read_training_log(f)
    assert (log.format, log.kind, log.split) == ("eagle", "marginal", "test")
    assert log.per_position == [0.69, 0.60]
    assert predicted_accept_length(log, 2)["accept_length"] == pytest.approx(1 + 0.69 + 0.69 * 0.60)


def test_eagle_wandb_epochacc_and_plain_printed_lines(tmp_path):
    f = tmp_path / "eagle.json"
    f.write_text(json.dumps({"test/epochacc_0": 0.6, "test/epochacc_1": 0.5, "train/epochacc_0": 0.7}))
    log = read_training_log(f)
    assert (log.format, log.split, log.per_position) == ("eagle", "test", [0.6, 0.5])
    g = tmp_path / "specforge.txt"
    g.write_text("step 100\nposition 0, Acc: 0.61\nposition 1, Acc: 0.52\nposition 2, Acc: 0.44\n")
    log = read_training_log(g)
    assert (log.format, log.kind) == ("specforge", "marginal") and log.per_position == [0.61, 0.52, 0.44]


def test_positions_missing_beyond_the_log_and_gaps_are_said(tmp_path):
    f = tmp_path / "short.json"
    f.write_text(json.dumps({"eval/acc_0": 0.8, "eval/acc_1": 0.6, "eval/acc_3": 0.3}))
    log = read_training_log(f)
    assert log.per_position == [0.8, 0.6] and any("position 2 is missing" in n for n in log.notes)
    out = predicted_accept_length(log, 5)
    assert not out["complete"] and out["positions_used"] == 2
    assert out["accept_length"] == pytest.approx(1 + 0.8 + 0.48)
    assert "positions 3..5 are missing" in out["note"] and "lower bound" in out["note"]


@pytest.mark.parametrize("content, msg", [
    (json.dumps({"loss": 1.0, "lr": 1e-4}), "eval/acc_<i>"),
    ("", "empty file"),
    (json.dumps({"eval/acc_0": 61.5}), "in [0, 1]"),
    ("epoch 1 loss 2.3\nepoch 2 loss 2.1\n", "position <i>, Acc: <x>"),
    (json.dumps([1, 2, 3]), "eval/acc_<i>"),
])
def test_unknown_or_bad_logs_are_one_line_bad_input(tmp_path, content, msg):
    f = tmp_path / "log.json"
    f.write_text(content)
    with pytest.raises(BadInput) as e:
        read_training_log(f)
    text = str(e.value)
    assert str(f) in text and msg in text and "\n" not in text


def test_bad_steps_and_missing_file(tmp_path):
    with pytest.raises(BadInput, match="not found"):
        read_training_log(tmp_path / "nope.json")
    log = read_training_log(REFERENCE_DRAFT / "training_log.json")
    with pytest.raises(BadInput, match="positive number of draft steps"):
        predicted_accept_length(log, 0)
    assert math.isclose(predicted_accept_length(log, 1)["accept_length"], 1 + log.per_position[0])
