"""``python -m helpers simulate``'s arguments: a step count past what it simulates is refused up front with one line
naming the flag, and a --samples the training data cannot give is said, not silently cut."""
from __future__ import annotations

import json

from helpers.__main__ import main
from support import ROOT

M = ROOT / "env" / "models"
ARGS = ["simulate", "--draft", str(M / "draft"), "--target", str(M / "target"), "--training",
        str(M / "data" / "sample")]


def test_steps_past_the_limit_are_refused_naming_the_flag(capsys):
    assert main(ARGS + ["--steps", "100000"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--steps 100000" in err[0] and "at most 64" in err[0], err


def test_more_samples_than_the_data_hold_are_said(capsys):
    code = main(ARGS + ["--samples", "64", "--json"])
    out = capsys.readouterr()
    b = json.loads(out.out)
    n = next(s for s in b["stages"] if s["name"] == "offline on training states")["sequences"]
    assert code in (0, 1) and n < 64
    assert f"--samples 64: the training data give {n} usable sample(s); all are used" in out.err
