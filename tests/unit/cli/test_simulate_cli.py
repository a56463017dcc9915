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


def test_a_given_draft_cost_is_used_and_said(capsys):
    """--draft-cost replaces the parameter ratio (a timing's figure, e.g. for a mixture-of-experts target): the
    settings stage's source says 'given' and a cost high enough moves the cost model's best chain to fewer steps."""
    assert main(ARGS + ["--draft-cost", "0.9", "--json"]) in (0, 1)
    b = json.loads(capsys.readouterr().out)
    st = next(s for s in b["stages"] if s["name"] == "best settings (simulated)")
    assert "(given)" in st["source"]
    best = max(b["settings_table"], key=lambda t: t["speedup_model"])
    assert best["steps"] <= 2, b["settings_table"]
    assert main(ARGS + ["--draft-cost", "-1"]) == 2
    assert "[--draft-cost]: -1.0 is no ratio in (0, 10)" in capsys.readouterr().err
