"""``python -m helpers diagnose``: JSON shape, exit codes 0 / 1 / 2, one-line reasons for bad input."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from support import ROOT
from support.forensic_cases import write_generate_json, write_rank_dumps, write_specforge
from helpers.diagnosis.detectors import FINDING_KINDS
from helpers.cli.diagnose import cli_main

CLEAN = ["out(1)", "out(3)", "out(4)"]
CHUNK_KEYS = {"index", "width", "matched_training_chunk", "share_within", "row_rel_diff_p50", "row_cosine_p50",
              "rel_diff", "cosine", "identified_as"}


@pytest.fixture
def clean_case(tmp_path, runner32, specs):
    train = write_specforge(tmp_path / "train", runner32, specs, CLEAN)
    served = write_generate_json(tmp_path / "served.json", runner32, specs, CLEAN)
    return tmp_path, train, served


def test_module_entry_point_clean_case_exits_0(clean_case, tiny_draft, tiny_target):
    _, train, served = clean_case
    r = subprocess.run([sys.executable, "-m", "helpers", "diagnose", "--training", str(train), "--served", str(served),
                        "--draft-config", str(tiny_draft), "--target-config", str(tiny_target), "--json"],
                       capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                       timeout=300)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert set(doc) == {"verdict", "findings", "chunks", "served_plan", "training_plan", "notes", "tolerance", "noise",
                        "alignment", "static"}
    assert doc["training_plan"]["provenance"] == "claimed"          # the draft config's ids, no manifest
    assert doc["tolerance"]["row_rel_diff"] == 1e-5 and "per-row rel_diff tolerance" in doc["tolerance"]["why"]
    assert doc["noise"]["pairs"] == 3
    assert doc["verdict"] == "ok" and doc["findings"] == []
    assert [set(c) for c in doc["chunks"]] == [CHUNK_KEYS] * 3
    assert [c["matched_training_chunk"] for c in doc["chunks"]] == [0, 1, 2]


def test_findings_exit_1_with_json_and_text(tmp_path, clean_case, runner32, specs, tiny_draft, tiny_target, capsys):
    _, train, _ = clean_case
    wrong = write_generate_json(tmp_path / "wrong.json", runner32, specs, ["out(1)", "out(3)", "out(5)"])
    args = ["--training", str(train), "--served", str(wrong), "--draft-config", str(tiny_draft),
            "--target-config", str(tiny_target)]
    assert cli_main(args + ["--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["verdict"] == "mismatch"
    assert all(set(f) == {"kind", "chunk", "detail", "evidence"} and f["kind"] in FINDING_KINDS for f in doc["findings"])
    assert [(f["kind"], f["chunk"]) for f in doc["findings"]] == [("wrong_layer", 2)]
    assert doc["chunks"][2]["matched_training_chunk"] is None and doc["chunks"][2]["rel_diff"] > 0.01
    assert cli_main(args) == 1
    text = capsys.readouterr().out
    assert "verdict: mismatch" in text and "[wrong_layer] chunk 2" in text and "served plan" in text


def test_per_rank_dumps_through_cli(tmp_path, clean_case, runner32, specs, capsys):
    _, train, _ = clean_case
    ranks = write_rank_dumps(tmp_path / "ranks", runner32, specs, CLEAN, 2)
    assert cli_main(["--training", str(train), "--served", str(ranks[1]), "--served", str(ranks[0]), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["verdict"] == "ok"


def _bad_cases(tmp, train, served, runner, specs):
    """name -> (argv, expected substring of the one-line reason)"""
    cases = {}
    other = [s.__class__(prompt=[300 + i for i in range(12)], continuation=[], output_ids=[5]) for s in specs[:1]]
    mism = write_generate_json(tmp / "mism.json", runner, other, CLEAN)
    cases["mismatched token ids"] = (["--training", str(train), "--served", str(mism)], "mismatched token ids")
    narrow = write_generate_json(tmp / "narrow.json", runner, specs, CLEAN, mutate=lambda i, r: r[:, :100])
    cases["width not divisible"] = (["--training", str(train), "--served", str(narrow)], "not a multiple")
    t2 = tmp / "t_trunc"
    t2.mkdir()
    data = (train / "rows_0-2000" / "data_0.ckpt").read_bytes()
    (t2 / "data_0.ckpt").write_bytes(data[: len(data) // 3])
    cases["truncated ckpt"] = (["--training", str(t2), "--served", str(served)], "truncated or corrupt")
    js = tmp / "trunc.json"
    js.write_text(served.read_text()[:-50])
    cases["truncated json"] = (["--training", str(train), "--served", str(js)], "not valid JSON, or truncated")
    t3 = tmp / "t_pickle"
    t3.mkdir()

    class Evil:
        def __reduce__(self):
            return (os.mkdir, (str(tmp / "PWNED"),))
    torch.save({"input_ids": torch.arange(3), "aux_hidden_state": torch.zeros(1, 3, 192), "x": Evil()},
               t3 / "data_0.ckpt")
    cases["pickled payload"] = (["--training", str(t3), "--served", str(served)], "refused")
    t4 = tmp / "t_empty"
    t4.mkdir()
    (t4 / "data_0.ckpt").write_bytes(b"")
    cases["empty training file"] = (["--training", str(t4), "--served", str(served)], "empty file")
    e = tmp / "empty.json"
    e.write_text("")
    cases["empty served file"] = (["--training", str(train), "--served", str(e)], "empty file")
    ed = tmp / "draft_empty"
    ed.mkdir()
    (ed / "config.json").write_text("")
    cases["empty draft config"] = (["--training", str(train), "--served", str(served), "--draft-config", str(ed)],
                                   "draft config is an empty file")
    cases["missing --served"] = (["--training", str(train)], "usage")
    cases["no such path"] = (["--training", str(tmp / "nope"), "--served", str(served)], "not found")
    return cases


CASE_NAMES = ["mismatched token ids", "width not divisible", "truncated ckpt", "truncated json", "pickled payload",
              "empty training file", "empty served file", "empty draft config", "missing --served", "no such path"]


@pytest.mark.parametrize("name", CASE_NAMES)
def test_bad_input_exit_2_one_line(name, clean_case, runner32, specs, capsys):
    tmp, train, served = clean_case
    argv, needle = _bad_cases(tmp, train, served, runner32, specs)[name]
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("diagnose: error: ") and "Traceback" not in err
    assert needle in err
    assert not (tmp / "PWNED").exists()


@pytest.mark.parametrize("bad", ["", "  ", "latest"])
def test_sglang_version_flag_must_be_a_version(bad, clean_case, tiny_draft, tiny_target, capsys):
    """An empty --sglang-version would silently mean "not given" (0.5.23 rules): bad input, with or without data."""
    _, train, served = clean_case
    for argv in (["--draft-config", str(tiny_draft), "--target-config", str(tiny_target)],
                 ["--training", str(train), "--served", str(served)]):
        assert cli_main(argv + ["--sglang-version", bad]) == 2
        err = capsys.readouterr().err
        assert err.startswith("diagnose: error:") and err.count("\n") == 1 and "--sglang-version" in err


def test_engine_sglang_given_explicitly_is_the_default(tiny_draft, tiny_target, capsys):
    """``--engine sglang`` (the default, named) on a plain EAGLE-3 draft gives the report the default gives (it
    was refused once: '--engine applies to MTP / NextN heads only')."""
    argv = ["--draft-config", str(tiny_draft), "--target-config", str(tiny_target), "--json"]
    rc0 = cli_main(argv)
    plain = json.loads(capsys.readouterr().out)
    rc1 = cli_main(argv + ["--engine", "sglang"])
    named = json.loads(capsys.readouterr().out)
    assert rc0 == rc1 == 0 and named["verdict"] == plain["verdict"] == "ok"
    assert named["served_plan"]["tensors"] == plain["served_plan"]["tensors"] == CLEAN


def test_more_layer_ids_than_a_draft_takes_is_exit_2(tmp_path, tiny_draft, tiny_target, capsys):
    """An EAGLE-3 draft config with 6000 ids (before: 5994 findings) is refused, naming the field."""
    cfg = json.loads((tiny_draft / "config.json").read_text())
    cfg.setdefault("eagle_config", {})["eagle_aux_hidden_state_layer_ids"] = list(range(6000))
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    rc = cli_main(["--draft-config", str(tmp_path / "config.json"), "--target-config", str(tiny_target)])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert "[eagle_config.eagle_aux_hidden_state_layer_ids]" in err and "at most 64 layer ids" in err, err
    assert "got 6000" in err
