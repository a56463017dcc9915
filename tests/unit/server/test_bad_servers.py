"""Reliability against misbehaving servers and repeated runs (issue 13), with small fake servers on 127.0.0.1
(tests/support/fakeserver.py, stopped by PID): overall deadlines, size limits, malformed answers, a server dying
mid-run, repeated labels, a full disk. Every failure is one line ``<command>: error: ...`` with exit 1 (server or
run failure) or 2 (bad input), within seconds."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from helpers.__main__ import main
from support import ROOT
from support.fakerun import write_training
from support.fakeserver import H, fake_server


@pytest.fixture(scope="module")
def training(tmp_path_factory) -> Path:
    """A 3-chunk, 16-wide training dump of two samples (the fake server's width)."""
    return write_training(tmp_path_factory.mktemp("train") / "train")


def _one_line_error(capsys, prog: str) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    errors = [ln for ln in err if ln.startswith(f"{prog}: error:")]
    assert len(errors) == 1, err
    assert "Traceback" not in "\n".join(err)
    return errors[0]


@pytest.mark.parametrize("mode", ["hang", "trickle"])
def test_capture_deadline_on_a_hanging_or_trickling_server(mode, training, tmp_path, capsys):
    with fake_server(mode) as url:
        t = time.monotonic()
        rc = main(["capture", "--url", url, "--training", str(training), "--run-dir", str(tmp_path),
                   "--num-samples", "1", "--timeout", "3"])
        took = time.monotonic() - t
    line = _one_line_error(capsys, "capture")
    assert rc == 1 and took < 20, (rc, took)
    assert "/generate" in line and url in line and "deadline of 3 s" in line and "elapsed" in line, line
    assert not (tmp_path / "dumps" / "served").exists()


def test_progress_lines_while_waiting(training, tmp_path, capsys):
    from helpers.server.client import SGLangClient

    lines = []
    with fake_server("hang") as url:
        c = SGLangClient(url, deadline_s=2.5, on_wait=lines.append, wait_every=0.5)
        with pytest.raises(Exception, match="deadline"):
            c.generate(input_ids=[1, 2], max_new_tokens=1)
        c.close()
    assert len(lines) >= 3 and all("still waiting for POST" in ln and "/generate" in ln for ln in lines), lines


def test_oversize_server_info_and_hidden_width(training, tmp_path, capsys):
    with fake_server("oversize") as url:
        rc = main(["capture", "--url", url, "--training", str(training), "--run-dir", str(tmp_path),
                   "--num-samples", "1", "--timeout", "60"])
        line = _one_line_error(capsys, "capture")
        assert rc == 1 and "/server_info" in line and "over the limit of 8.0 MiB" in line, line
        from helpers.capture import capture_served
        from helpers.errors import SGLangError
        from helpers.server.client import SGLangClient

        c = SGLangClient(url, max_info_bytes=64 << 20)
        with pytest.raises(SGLangError, match="200000 wide, over the limit of 256"):
            capture_served(c, [[1, 2, 3]], tmp_path / "dumps", name="wide", max_width=16 * H, progress=False)
        c.close()
    assert not (tmp_path / "dumps" / "wide").exists()


def test_malformed_generate_answers_name_the_endpoint_and_field(training, tmp_path, capsys):
    with fake_server("malformed") as url:
        rc = main(["capture", "--url", url, "--training", str(training), "--run-dir", str(tmp_path),
                   "--num-samples", "2", "--timeout", "30"])
        line = _one_line_error(capsys, "capture")
        assert rc == 1 and "/generate" in line and ("meta_info" in line or "field" in line), line
        rc = main(["measure", "--url", url, "--num-prompts", "4", "--max-new-tokens", "4", "--outputs",
                   str(tmp_path / "m"), "--quiet", "--timeout", "30"])
    line = _one_line_error(capsys, "measure")
    assert rc == 1 and "requests failed" in line, line


def test_measure_exits_1_when_the_server_dies_mid_run(tmp_path, capsys):
    with fake_server("die") as url:
        rc = main(["measure", "--url", url, "--num-prompts", "6", "--max-new-tokens", "4", "--warmup", "0",
                   "--no-flush", "--outputs", str(tmp_path), "--quiet", "--timeout", "60"])
    line = _one_line_error(capsys, "measure")
    assert rc == 1 and "of 6 requests failed" in line, line
    (summary,) = list(tmp_path.glob("*/fixes/server/summary.json"))
    assert json.loads(summary.read_text())["summary"]["n_failed"] >= 3


def test_repeated_labels_never_overwrite_a_measurement(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    with fake_server("ok") as url:
        args = ["measure", "--url", url, "--num-prompts", "3", "--max-new-tokens", "4", "--label", "same",
                "--run-dir", str(run), "--quiet", "--timeout", "60", "--warmup", "0"]
        assert main(args) == 0
        assert main(args) == 0
        # two at once, as separate processes
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        procs = [subprocess.Popen([sys.executable, "-m", "helpers", *args], cwd=ROOT, env=env,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for _ in range(2)]
        assert [p.wait(timeout=180) for p in procs] == [0, 0], [p.stderr.read() for p in procs]
    folders = sorted(p.name for p in (run / "fixes").iterdir())
    assert folders == ["same", "same-2", "same-3", "same-4"], folders
    for f in folders:
        assert sorted(x.name for x in (run / "fixes" / f).iterdir()) == ["per_request.parquet", "positions.csv",
                                                                          "summary.json"]
    ledger = pd.read_parquet(run / "ledger.parquet")
    assert sorted(ledger["saved_to"]) == [f"fixes/{f}" for f in folders]


def test_bad_local_inputs_are_one_line_exit_2(tmp_path, training, capsys):
    bad = tmp_path / "prompts.jsonl"
    bad.write_text('{"text": "ok"}\nnot json\n')
    assert main(["measure", "--url", "http://127.0.0.1:9", "--prompts", str(bad)]) == 2
    line = _one_line_error(capsys, "measure")
    assert str(bad) in line and "line 2" in line, line
    assert main(["measure", "--url", "http://127.0.0.1:9", "--run-dir", str(tmp_path / "nope")]) == 2
    assert "--run-dir must be an existing run folder" in _one_line_error(capsys, "measure")
    assert main(["suite", "run", "--params", str(tmp_path)]) == 2
    assert "must be a YAML file, not a folder" in _one_line_error(capsys, "suite")
    f = tmp_path / "file"
    f.write_text("x")
    assert main(["suite", "run", "--params", "env/cases/main.yaml", "--out", str(f)]) == 2
    assert "--out must be a folder" in _one_line_error(capsys, "suite")
    assert main(["capture", "--url", "http://127.0.0.1:9", "--training", str(training), "--num-samples", "0"]) == 2
    _one_line_error(capsys, "capture")


def test_full_disk_is_one_line_and_leaves_no_partial_measurement(tmp_path, capsys):
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here (needs root); the ENOSPC path is then untested")
    try:
        (mnt / "filler").write_bytes(b"\0" * (60 << 10))
        (mnt / "run").mkdir()
        with fake_server("ok") as url:
            rc = main(["measure", "--url", url, "--num-prompts", "3", "--max-new-tokens", "4", "--label", "full",
                       "--run-dir", str(mnt / "run"), "--quiet", "--timeout", "60", "--warmup", "0"])
        line = _one_line_error(capsys, "measure")
        assert rc == 1 and "no space left on the device" in line, line
        leftovers = [p.name for p in (mnt / "run").rglob("*")]
        assert not any(n.startswith("full") or n.endswith(".tmp") for n in leftovers), leftovers
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)


def test_a_failed_run_folder_is_removed_when_empty_or_marked(tmp_path, training, capsys):
    from helpers.runfiles import mark_failed

    empty = tmp_path / "empty"
    (empty / "dumps").mkdir(parents=True)
    assert mark_failed(empty, "capture: error") is None and not empty.exists()
    half = tmp_path / "half"
    (half / "dumps").mkdir(parents=True)
    (half / "dumps" / "x.json").write_text("{}")
    assert mark_failed(half, "suite: OSError: no space") == half / "FAILED"
    assert (half / "FAILED").read_text() == "suite: OSError: no space\n"
    # investigate against an unreachable server: one line, exit 1, the run folder holds the partial record + FAILED
    rc = main(["investigate", "--url", "http://127.0.0.1:9", "--training", str(training), "--out",
               str(tmp_path / "runs"), "--timeout", "20"])
    line = _one_line_error(capsys, "investigate")
    assert rc == 1 and "cannot connect" in line, line
    (run,) = list((tmp_path / "runs").iterdir())
    assert (run / "FAILED").exists() and json.loads((run / "investigation.json").read_text())["error"]
