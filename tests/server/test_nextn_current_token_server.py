"""The generated MTP engine fault ``current_token`` on a live SGLang 0.5.23 NEXTN server (extended tier; one server
for the module): the Kimi-class target at TP 1, 1 step, with the draft step trace and the test-only
``embed_current_token`` hook (tests/support/engine_faults.py) armed by a file.

* Unarmed: ``--check-draft`` says the served head ``matches`` and names nothing.
* Armed with the first draw of ``current_token`` whose share is >= 0.5 (seed 0: 0.573): the check names
  ``draft_extend_ids_unshifted``, the un-rotated replay explaining >= 75 % of the diverging step-1 rows and the
  right ids none, in each probe that names it (bench/bench_current_token.py measured 40 of 42 on this draw).
"""
from __future__ import annotations

import json
import re
import time
from itertools import count

import pytest

from helpers.investigation.check_draft import check_draft
from helpers.server.process import stop_pid
from support.mtp_faults import ENGINE_CLASSES, TARGET, draw, engine_hook_specs
from test_investigate_live import _cli

pytestmark = pytest.mark.extended


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    if not (TARGET / "nextn_training_log.json").is_file():
        pytest.skip("the Kimi-class target's NextN head is not built here")
    tmp = tmp_path_factory.mktemp("nextn-current-token")
    arm = tmp / "ARM"
    fault = draw(next(s for s in count() if draw(s, ENGINE_CLASSES).params["strength"] >= 0.5), ENGINE_CLASSES)
    t0 = time.monotonic()
    out = _cli("server", "start", "--target", str(TARGET), "--nextn", "--tp", "1", "--steps", "1", "--detach",
               "--timeout", "900", "--trace-draft", str(tmp / "trace"),
               "--forward-hooks", json.dumps(engine_hook_specs(fault, arm=str(arm))), timeout=1200)
    assert out.returncode == 0, out.stderr[-3000:]
    url = re.search(r"ready: (http://127\.0\.0\.1:\d+)", out.stdout).group(1)
    pid = int(re.search(r"\(pid (\d+)", out.stdout).group(1))
    print(f"\n[current token] NEXTN server with the trace and the fault (unarmed) ready in {time.monotonic() - t0:.1f} s")
    try:
        yield url, arm, fault, tmp
    finally:
        arm.unlink(missing_ok=True)
        stop_pid(pid)


def test_clean_then_the_fault_named_with_the_replay_as_evidence(served):
    url, arm, fault, tmp = served
    t0 = time.monotonic()
    clean = check_draft(url, run_dir=tmp / "clean", timeout=600)
    print(f"[current token] clean check: {time.monotonic() - t0:.1f} s; {clean['verdict']}")
    assert clean["verdict"] == "matches" and clean["findings"] == [], clean["reason"]
    arm.write_text(json.dumps({"strength": fault.params["strength"], "seed": fault.params["hook_seed"]}))
    t0 = time.monotonic()
    doc = check_draft(url, run_dir=tmp / "faulty", timeout=600, prompts=4, max_new_tokens=24)
    print(f"[current token] armed check ({fault.label()}): {time.monotonic() - t0:.1f} s; {doc['verdict']}")
    named = [f for f in doc["findings"] if f["kind"] == "draft_extend_ids_unshifted"]
    assert doc["verdict"] == "differs" and named, doc["reason"]
    for f in named:                                # each probe that names it: its own replay's counts
        ct = f["evidence"]["current_token"]
        assert ct["diverging"] >= 3 and ct["explained"] >= 0.75 * ct["diverging"] and ct["right_ids"] == 0, ct
    assert sum(f["evidence"]["current_token"]["diverging"] for f in named) >= 10, named
