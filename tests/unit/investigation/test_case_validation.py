"""The bundled case files (env/cases) validate, and a bad case file is refused with the field named, by
helpers.investigation.cases and by ``python -m helpers replay`` (exit 2, nothing created). Their replays on
the reference server: tests/server/test_cases.py."""
from __future__ import annotations

import pytest

from helpers.errors import CaseError
from helpers.investigation.cases import load_case, load_recorded_case
from support import ROOT

CASES = sorted((ROOT / "env" / "cases").glob("*.yaml"))
#: recorded cases (a top-level ``recording:``, helpers.investigation.recorded) have their own format
RECORDED = [c for c in CASES if any(line.startswith("recording:") for line in c.read_text().splitlines())]
CASE_FILES = [c for c in CASES if c.name != "main.yaml" and c not in RECORDED]


def test_all_bundled_cases_validate():
    assert len(CASE_FILES) >= 7
    for path in CASE_FILES:
        case = load_case(path)
        assert case.timeline[0].kind == "fix"
        assert any(s.kind == "hypothesis" and s.expect for s in case.timeline), path


def test_recorded_cases_validate_and_a_bad_one_names_the_field(tmp_path):
    assert RECORDED
    for path in RECORDED:
        case = load_recorded_case(path)
        assert case.resolve(case.recording).is_dir() and case.faults and case.expect_finding, path
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\ntitle: t\ntarget: t\nrecording: r\nfaults: [{kind: wrong_layer, chunk: 0}]\n")
    with pytest.raises(CaseError, match=r"faults.*needs field\(s\) \['layer'\]"):
        load_recorded_case(bad)


def test_case_validation_names_the_field(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\ntitle: t\ntimeline:\n  - hypothesis: {check: no_such_check}\n")
    with pytest.raises(CaseError, match=r"timeline\.0\.hypothesis\.check.*unknown check"):
        load_case(bad)
    bad.write_text("name: x\ntitle: t\ntimeline:\n  - hypothesis: {check: tp_sharding}\n")
    with pytest.raises(CaseError, match="before any fix"):
        load_case(bad)
    bad.write_text("name: x\ntitle: t\ntimeline:\n  - fix: {name: f, faults: [{kind: bogus}]}\n")
    with pytest.raises(CaseError, match="unknown fault kind"):
        load_case(bad)
    with pytest.raises(CaseError, match="does not exist"):
        load_case(tmp_path / "missing.yaml")
    # issue 40: no extra flag may move the replay's servers off 127.0.0.1 (the case's server block or a fix's launch)
    bad.write_text("name: x\ntitle: t\nserver: {extra_args: ['--host', '0.0.0.0']}\ntimeline:\n  - fix: {name: f}\n")
    with pytest.raises(CaseError, match=r"server\.extra_args.*'--host' among extra_args sets --host"):
        load_case(bad)
    bad.write_text("name: x\ntitle: t\ntimeline:\n  - fix: {name: f, launch: {extra_args: ['--dist-init-addr=h:1']}}\n")
    with pytest.raises(CaseError, match=r"extra_args.*sets --dist-init-addr"):
        load_case(bad)


def test_replay_cli_rejects_a_bad_case_with_status_2(tmp_path, capsys):
    from helpers.__main__ import main

    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\ntitle: t\ntimeline:\n  - hypothesis: {check: no_such_check}\n")
    assert main(["replay", str(bad), "--out", str(tmp_path / "out")]) == 2
    assert "unknown check" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # nothing created for a case that does not validate
