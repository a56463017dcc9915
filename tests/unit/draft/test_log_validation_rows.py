"""The NextN / EAGLE-1 draft stage's ``validation_rows`` block of a training log (helpers/draft/training_log.py::
validation_rows_checked, read by helpers/draft/nextn_stage.py): an accuracy outside [0, 1], a string, a NaN, or a
block that is no object is one BadInput line naming the log and the field, before any row is run (it would
otherwise give a false ``counts``, a bare ValueError, a CI of NaN, or be ignored). On copies of the real EAGLE-1 draft
env/models/llama_h64/draft_eagle1 and its trainer's log."""
from __future__ import annotations

import json
import shutil

import pytest

from helpers.draft.eagle1_stage import eagle1_draft_stage
from helpers.draft.loader import load_draft
from helpers.draft.nextn_stage import rows_log
from helpers.draft.training_log import validation_rows_checked
from helpers.errors import BadInput
from helpers.formats.rows import rows_kind
from support import ROOT

H64 = ROOT / "env" / "models" / "llama_h64"
DRAFT = H64 / "draft_eagle1"
LOG = json.loads((DRAFT / "training_log.json").read_text())


def test_the_real_log_passes_and_keeps_its_figures():
    vr = validation_rows_checked(LOG, DRAFT / "training_log.json")
    assert vr["acc_per_step"] == LOG["validation_rows"]["acc_per_step"] and 0 < vr["acc_per_step"][0] < 1
    log = rows_log(LOG, DRAFT / "training_log.json", rows_kind(DRAFT / "validation"))
    assert log.per_position == LOG["validation_rows"]["acc_per_step"]
    assert validation_rows_checked({k: v for k, v in LOG.items() if k != "validation_rows"}, "x") is None


@pytest.mark.parametrize("edit,field,needle", [
    (lambda v: v.update(acc_per_step=[1.7]), "validation_rows.acc_per_step[0]", "expected an accuracy in [0, 1]"),
    (lambda v: v.update(acc_per_step=[0.5, "x"]), "validation_rows.acc_per_step[1]", "expected a number, got 'x'"),
    (lambda v: v.update(acc_per_step=[float("nan")]), "validation_rows.acc_per_step[0]", "expected a finite number"),
    (lambda v: v.update(acc_per_step=0.36), "validation_rows.acc_per_step", "expected a list of numbers"),
    (lambda v: v.update(loss_per_step=[None]), "validation_rows.loss_per_step[0]", "expected a number"),
    (lambda v: v.update(rows="32"), "validation_rows.rows", "expected a positive integer"),
    (lambda v: v.update(path=7), "validation_rows.path", "expected a folder path"),
])
def test_malformed_figures_are_one_line_naming_log_and_field(edit, field, needle):
    doc = json.loads(json.dumps(LOG))
    edit(doc["validation_rows"])
    with pytest.raises(BadInput) as e:
        validation_rows_checked(doc, "/d/training_log.json")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"/d/training_log.json [{field}]: ") and needle in msg


@pytest.mark.parametrize("vr,field,needle", [
    ({"acc_per_step": [1.7]}, "validation_rows.acc_per_step[0]", "expected an accuracy in [0, 1], got 1.7"),
    ({"acc_per_step": ["x"]}, "validation_rows.acc_per_step[0]", "expected a number, got 'x'"),
    ({"acc_per_step": [float("nan")]}, "validation_rows.acc_per_step[0]", "expected a finite number"),
    ("validation", "validation_rows", "expected an object"),
])
def test_the_eagle1_draft_stage_refuses_them(tmp_path, vr, field, needle):
    d = tmp_path / "draft"
    shutil.copytree(DRAFT, d)
    doc = json.loads(json.dumps(LOG))
    doc["validation_rows"] = ({**doc["validation_rows"], **vr} if isinstance(vr, dict) else vr)
    (d / "training_log.json").write_text(json.dumps(doc))
    head = load_draft(d, H64 / "target")
    with pytest.raises(BadInput) as e:
        eagle1_draft_stage(head, H64 / "target", 1, draft_dir=d, max_rows=8)
    msg = str(e.value)
    assert "\n" not in msg and str(d / "training_log.json") in msg and f"[{field}]" in msg and needle in msg
