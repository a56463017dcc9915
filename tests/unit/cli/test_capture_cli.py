"""`python -m helpers capture`: argument and input errors exit 2 with one line on stderr, nothing written.
(The capture itself runs against real servers in tests/suite/test_suite.py through the hypotheses.)"""
from __future__ import annotations

import socket

import pytest

from helpers.__main__ import main


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def test_capture_help(capsys):
    assert main(["capture", "--help"]) == 0
    assert "--timeout" in capsys.readouterr().out


def test_capture_missing_training_data(tmp_path, capsys):
    rc = main(["capture", "--url", "http://127.0.0.1:1", "--training", str(tmp_path / "nope"),
               "--run-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "nope" in err and "\n" not in err
    assert not (tmp_path / "run").exists()


def test_capture_unreachable_server(tmp_path, capsys, runner32, specs):
    from support.forensic_cases import write_specforge

    train = write_specforge(tmp_path / "train", runner32, specs, ["out(1)", "out(3)", "out(4)"])
    (tmp_path / "run").mkdir()
    rc = main(["capture", "--url", f"http://127.0.0.1:{_closed_port()}", "--training", str(train),
               "--run-dir", str(tmp_path / "run"), "--num-samples", "1"])
    err = capsys.readouterr().err.strip()
    # a server failure: exit 1 (bad input is 2), one line "capture: error: ..."
    assert rc == 1 and err.startswith("capture: error:") and "cannot connect" in err and "\n" not in err
    assert not (tmp_path / "run" / "dumps" / "served").exists()
