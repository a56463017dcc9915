"""Argument errors (paths, names, encodings) are found before any work starts (issue 21, causes 8, 9 and 11): exit 2
with one line naming the argument, before a request is sent -- the server URLs here are closed ports, so a command
that worked first would fail with exit 1 "cannot connect" instead -- and nothing is written."""
from __future__ import annotations

import os

import pytest

from helpers.__main__ import main
from support.fakerun import write_training
from support.fakeserver import free_port

NOT_UTF8 = os.fsdecode(b"run-\xff")


@pytest.fixture(scope="module")
def training(tmp_path_factory):
    return write_training(tmp_path_factory.mktemp("train") / "train")


@pytest.fixture
def closed_url() -> str:
    return f"http://127.0.0.1:{free_port()}"


def _line(capsys, prog: str) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"{prog}: error:"), err
    return err[0]


def test_measure_outputs_that_is_a_file_is_refused_before_measuring(tmp_path, closed_url, capsys):
    f = tmp_path / "file"
    f.write_text("x")
    assert main(["measure", "--url", closed_url, "--outputs", str(f), "--quiet"]) == 2
    line = _line(capsys, "measure")
    assert "--outputs must be a folder" in line and str(f) in line, line


def test_investigate_out_that_is_a_file_is_refused_before_attaching(tmp_path, closed_url, training, capsys):
    f = tmp_path / "file"
    f.write_text("x")
    assert main(["investigate", "--url", closed_url, "--training", str(training), "--out", str(f)]) == 2
    line = _line(capsys, "investigate")
    assert "--out must be a folder" in line and str(f) in line, line


def test_names_that_are_not_utf8_are_refused_before_any_work(tmp_path, closed_url, training, capsys):
    assert main(["investigate", "--url", closed_url, "--training", str(training), "--out",
                 str(tmp_path / NOT_UTF8)]) == 2
    assert "--out" in (line := _line(capsys, "investigate")) and "not valid UTF-8" in line and "\\udcff" in line
    assert main(["measure", "--url", closed_url, "--label", NOT_UTF8, "--outputs", str(tmp_path), "--quiet"]) == 2
    assert "--label" in (line := _line(capsys, "measure")) and "not valid UTF-8" in line, line
    assert main(["capture", "--url", closed_url, "--training", str(training), "--name", NOT_UTF8]) == 2
    assert "--name" in (line := _line(capsys, "capture")) and "not valid UTF-8" in line, line
    assert sorted(os.listdir(tmp_path)) == []


def test_capture_into_an_existing_dump_is_refused_before_capturing(tmp_path, closed_url, training, capsys):
    (tmp_path / "dumps" / "served").mkdir(parents=True)
    assert main(["capture", "--url", closed_url, "--training", str(training), "--run-dir", str(tmp_path)]) == 2
    line = _line(capsys, "capture")
    assert str(tmp_path / "dumps" / "served") in line and "exists" in line, line
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["dumps", "served"]


@pytest.mark.parametrize("name", ["../../escaped", "/tmp/e3f-absolute-dump", "..", "a/b"])
def test_capture_name_stays_inside_the_run_folder(name, tmp_path, closed_url, training, capsys):
    run = tmp_path / "a" / "b" / "run"
    run.mkdir(parents=True)
    assert main(["capture", "--url", closed_url, "--training", str(training), "--run-dir", str(run),
                 "--name", name]) == 2
    line = _line(capsys, "capture")
    assert "--name" in line and "plain folder name" in line, line
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["a", "b", "run"]


@pytest.mark.parametrize("cmd,why", [("'unterminated", "not a command line"), ("   ", "an empty command"),
                                     ("/nonexistent/bin/sglang --port 1", "neither a file nor on $PATH")])
def test_investigate_refuses_a_relaunch_that_cannot_run_before_any_request(training, tmp_path, closed_url, capsys,
                                                                           cmd, why):
    assert main(["investigate", "--url", closed_url, "--training", str(training), "--relaunch", cmd,
                 "--out", str(tmp_path / "runs")]) == 2
    line = _line(capsys, "investigate")
    assert "--relaunch" in line and why in line, line
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


@pytest.mark.parametrize("cost", ["0", "-0.5", "nan"])
def test_investigate_draft_cost_that_is_no_ratio_is_refused_before_attaching(tmp_path, closed_url, training, capsys,
                                                                              cost):
    assert main(["investigate", "--url", closed_url, "--training", str(training), "--out", str(tmp_path),
                 "--draft-cost", cost]) == 2
    line = _line(capsys, "investigate")
    assert "[--draft-cost]" in line and f"{float(cost)} is no ratio in (0, 10)" in line, line
    assert not any(tmp_path.iterdir())
