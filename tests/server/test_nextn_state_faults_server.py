"""The draft-state engine fault ``kv_wrong_slot`` on a live SGLang 0.5.23 NEXTN server (extended tier; one server):
the Kimi-class target's own NextN head at TP 1 with 3 draft steps and the draft step trace, the fault's hook on the
head's MLA decode attention (``tests/support/engine_faults.py::specs(..., draft="nextn")``:
``model.decoder.self_attn.attn_mqa``), off until its arm file exists. ``step_trace`` on 12 prompts x 24 tokens:
clear unarmed; armed (every draft decode row's latent KV also written over the previous slot), the head's proposals
equal the offline head's at draft step 1 and differ from step 2 on: ``draft_kv_diverges``."""
from __future__ import annotations

import json
import os
import re
import time

import pytest

from helpers.acceptance.prompts import load_prompts
from helpers.budget import Budget
from helpers.engines.detect import detect
from helpers.investigation.attach import attach
from helpers.investigation.probes import ProbeContext, run_probes
from helpers.runfiles import new_run_dir
from helpers.server.process import stop_pid
from support import ROOT
from support.engine_faults import specs
from test_investigate_live import _cli, registry  # noqa: F401  (registry: state files in a temporary folder)

pytestmark = pytest.mark.extended
TARGET = ROOT / "env" / "models" / "kimi" / "target"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    if not (TARGET / "nextn_training_log.json").is_file():
        pytest.skip("the Kimi-class target's NextN head is not built here")
    tmp = tmp_path_factory.mktemp("nextn-state")
    hooks, _, kv_arm = specs(str(tmp), draft="nextn")
    hooks = [h for h in hooks if h["name"] == "test-kv-slot"]
    t0 = time.monotonic()
    out = _cli("server", "start", "--target", str(TARGET), "--nextn", "--tp", "1", "--steps", "3", "--detach",
               "--timeout", "900", "--trace-draft", str(tmp / "trace"), "--forward-hooks", json.dumps(hooks),
               timeout=1200)
    assert out.returncode == 0, out.stderr[-3000:]
    url = re.search(r"ready: (http://127\.0\.0\.1:\d+)", out.stdout).group(1)
    pid = int(re.search(r"\(pid (\d+)", out.stdout).group(1))
    print(f"\n[nextn state] NEXTN server (3 steps) with the trace and kv_wrong_slot (unarmed) ready in "
          f"{time.monotonic() - t0:.1f} s")
    try:
        yield url, tmp, kv_arm
    finally:
        stop_pid(pid)


def _step_trace(url, tmp, tag) -> dict:
    ad = detect(url, None, deadline_s=30).adapter
    dl = Budget(900)
    c = ad.client(url, None, timeout=180, budget=dl)
    try:
        ctx = ProbeContext(client=c, adapter=ad, att=attach(c, caveats=ad.capture_caveats),
                           run_dir=new_run_dir(tag, tmp), prompts=load_prompts(None, n=12), max_new_tokens=24, dl=dl)
        t0 = time.monotonic()
        (p,) = run_probes(ctx, "cheap", only=["step_trace"])["probes"]
        print(f"[nextn state] step_trace {tag}: {time.monotonic() - t0:.1f} s, {p['decision']}, first steps "
              f"{p['evidence'].get('first_steps')}")
        return p
    finally:
        c.close()


def test_kv_wrong_slot_on_the_head_is_draft_kv_diverges_and_clear_unarmed(served):
    url, tmp, arm = served
    p = _step_trace(url, tmp, "unarmed")
    assert p["status"] == "ran" and p["decision"] == "clear" and p["findings"] == [], p
    assert p["evidence"]["mtp"]["use"] == "offline head"
    open(arm, "w").write("armed by test_nextn_state_faults_server\n")
    try:
        p = _step_trace(url, tmp, "armed")
    finally:
        os.unlink(arm)
    assert p["decision"] == "counts" and [f["kind"] for f in p["findings"]] == ["draft_kv_diverges"], p
    firsts = [s for s in p["evidence"]["first_steps"].values() if s is not None]
    assert firsts and min(firsts) >= 2, firsts                  # step 1 (the draft-extend rows) never changes
