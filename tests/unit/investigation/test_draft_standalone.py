"""The seeds' standalone draft test (``check_draft_standalone``) on the trained Kimi-class Llama-style draft, offline
(no server): the trained checkpoint matches its training log (refuted), the same checkpoint with its fc damaged
does not (confirmed), and a draft folder without its log cannot be judged (inconclusive). Real tensors, the draft run
as SGLang 0.5.23 runs it (helpers.draft)."""
from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers.investigation.checks import run_check
from helpers.investigation.inputs import Investigation
from support import ROOT

KIMI = ROOT / "env" / "models" / "kimi"
pytestmark = pytest.mark.skipif(not (KIMI / "draft" / "training_log.json").exists(),
                                reason="the Kimi-class models (env/models/kimi) are not built")


def _inv(tmp_path, draft):
    return Investigation(tmp_path / "run", None, training=KIMI / "data" / "sample", draft_dir=draft,
                         target_dir=KIMI / "target", num_samples=3)


def _copy_draft(tmp_path, *, damage: bool = False, log: bool = True):
    d = tmp_path / "draft"
    shutil.copytree(KIMI / "draft", d)
    if not log:
        (d / "training_log.json").unlink()
    if damage:     # the fc that mixes the three aux chunks, permuted along its output: the draft's own fault
        w = load_file(d / "model.safetensors")
        g = torch.Generator().manual_seed(0)
        w["fc.weight"] = w["fc.weight"][torch.randperm(w["fc.weight"].shape[0], generator=g)].contiguous()
        save_file(w, d / "model.safetensors")
    return d


def test_trained_draft_is_as_good_as_its_log(tmp_path):
    r = run_check("draft_standalone", _inv(tmp_path, KIMI / "draft"))
    assert r.verdict == "refuted", r.explanation
    d = r.data
    assert d["settings"] == {"steps": 3, "topk": 1, "draft_tokens": 4}
    assert d["draft_loss"]["decision"] == "clear" and d["wiring_loss"] is None     # no server: no served states
    stages = {s["name"]: s for s in d["stages"]}
    log, ck = stages["training log"]["accept_length"], stages["checkpoint (teacher-forced)"]["accept_length"]
    assert abs(log - ck) < 0.1 and ck > 2.0, (log, ck)                  # the log says 2.24 (training_log.json)
    assert stages["offline on training states"]["accept_length"] > 2.0
    assert list(r.evidence["stage"])[:3] == ["training log", "checkpoint (teacher-forced)",
                                             "offline on training states"]
    assert "as good as its training log" in r.explanation and r.figure is not None


def test_damaged_draft_is_confirmed_and_a_missing_log_is_inconclusive(tmp_path):
    bad = run_check("draft_standalone", _inv(tmp_path / "a", _copy_draft(tmp_path / "a", damage=True)))
    assert bad.verdict == "confirmed", bad.explanation
    stages = {s["name"]: s for s in bad.data["stages"]}
    assert stages["checkpoint (teacher-forced)"]["accept_length"] < stages["training log"]["accept_length"] - 0.3
    assert bad.data["draft_loss"]["decision"] == "counts" and "scores below its training log" in bad.data["short"]
    none = run_check("draft_standalone", _inv(tmp_path / "b", _copy_draft(tmp_path / "b", log=False)))
    assert none.verdict == "inconclusive" and "no training log" in none.explanation, none.explanation
