"""The config-only check on real public EAGLE-3 draft configs (``tests/data/public_configs.yaml``: SpecForge
``configs/`` and PRs, SafeAILab EAGLE, a speculators conversion, each paired with its target's config and
cited; and whole config.json files of SpecForge, AngelSlim, TorchSpec, speculators and EAGLE drafts with their
targets'), against the served plan and verdict SGLang 0.5.23's source implies (the rule named in each entry)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from helpers.cli.diagnose import cli_main
from helpers.diagnosis.static import static_check
from support import DATA

CONFIGS = DATA / "public_configs.yaml"
ENTRIES = yaml.safe_load(CONFIGS.read_text())


def _write(tmp: Path, e: dict) -> tuple[Path, Path]:
    """The entry's draft and target configs as two folders: the transcribed fields, or the whole file (``*_file``)."""
    d, t = tmp / "draft", tmp / "target"
    d.mkdir()
    t.mkdir()
    for role, folder in (("draft", d), ("target", t)):
        text = (DATA / e[f"{role}_file"]).read_text() if f"{role}_file" in e else json.dumps(e[role])
        (folder / "config.json").write_text(text)
    return d, t


def test_the_collection_is_real_and_cited():
    assert len(ENTRIES) >= 20
    for e in ENTRIES:
        src = e["draft_source"]
        assert ("repo" in src and "path" in src) or "url" in src, e["name"]
        assert e.get("target_source"), e["name"]
    checkable = [e for e in ENTRIES if e.get("expected")]
    assert len(checkable) >= 20
    verdicts = {e["expected"]["verdict"] for e in checkable}
    assert verdicts == {"ok", "mismatch", "ambiguous"}        # the corpus exercises all three


@pytest.mark.parametrize("entry", [e for e in ENTRIES if e.get("expected")], ids=lambda e: e["name"])
def test_public_config(tmp_path, entry):
    d, t = _write(tmp_path, entry)
    rep = static_check(d, t)
    exp = entry["expected"]
    assert rep.served_plan.tensors == exp["served"], rep.render_text()
    assert rep.verdict == exp["verdict"], rep.render_text()
    assert sorted({f["kind"] for f in rep.findings}) == sorted(exp["findings"]), rep.render_text()
    # every finding and plan says where it came from
    assert rep.served_plan.provenance == "rule" and "sglang/srt/models/" in rep.served_plan.source
    if rep.training_plan is not None:
        assert rep.training_plan.provenance in ("claimed", "default") and rep.training_plan.source


def test_unknown_target_fields_are_a_clear_error(tmp_path, capsys):
    e = next(e for e in ENTRIES if not e.get("expected"))
    d, t = _write(tmp_path, e)
    assert cli_main(["--draft-config", str(d), "--target-config", str(t)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("diagnose: error:") and "config.json" in err and "expected a positive integer" in err
