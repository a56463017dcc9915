"""The engine-state probes and ``--check-draft`` on a live SGLang 0.5.23 NEXTN server (extended tier; one server
for the module): the Kimi-class target at TP 1, 1 step, with the every-layer capture, the draft step trace
(``server start --nextn --trace-draft``) and the ``verify_swap`` engine fault of ``tests/support/engine_faults.py``
(in target verify the target's two best logits of a share of the rows swapped: speculation no longer lossless),
off until its arm file exists.

* Unarmed: ``investigate`` with the cheap probes is ``ok`` (every cheap probe that applies to a head ran and is
  clear: the served head's proposals equal its offline head's step by step, a radix hit and T = 1 accept exactly
  what cold greedy does); ``--check-draft`` says the served head ``matches``.
* Armed, ``--engine-probes all``: the cold budget still clears (verification picks the swapped token for the
  served answer and the offline replay reads the same answer), the oracle is skipped as not applying to a head,
  the restarted target alone names ``speculation_not_lossless`` in the engine stage's verification part.
"""
from __future__ import annotations

import json
import re
import time

import pytest

from helpers.investigation.check_draft import check_draft
from helpers.investigation.live import investigate
from helpers.server.process import stop_pid
from support import ROOT
from support.engine_faults import spec as engine_fault
from test_investigate_live import _cli, registry  # noqa: F401  (registry: state files in a temporary folder)

pytestmark = pytest.mark.extended
TARGET = ROOT / "env" / "models" / "kimi" / "target"
VALIDATION = ROOT / "env" / "models" / "kimi" / "data" / "validation"
PROMPTS, NEW = 12, 24


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    if not (TARGET / "nextn_training_log.json").is_file() or not VALIDATION.is_dir():
        pytest.skip("the Kimi-class target's NextN head or its validation rows are not built here")
    tmp = tmp_path_factory.mktemp("nextn-probes")
    arm = tmp / "ARM_SWAP"
    hooks = [engine_fault("verify_swap", strength=0.3, seed=1, arm=str(arm))]
    t0 = time.monotonic()
    out = _cli("server", "start", "--target", str(TARGET), "--nextn", "--tp", "1", "--steps", "1", "--detach",
               "--timeout", "900", "--capture-layers", str(tmp / "layers"), "--trace-draft", str(tmp / "trace"),
               "--forward-hooks", json.dumps(hooks), timeout=1200)
    assert out.returncode == 0, out.stderr[-3000:]
    url = re.search(r"ready: (http://127\.0\.0\.1:\d+)", out.stdout).group(1)
    pid = int(re.search(r"\(pid (\d+)", out.stdout).group(1))
    print(f"\n[nextn probes] NEXTN server with the trace and verify_swap (unarmed) ready in "
          f"{time.monotonic() - t0:.1f} s")
    try:
        yield url, arm, tmp
    finally:
        stop_pid(pid)


def _investigate(url, run_dir, probes):
    t0 = time.monotonic()
    doc = investigate(url, training=None, run_dir=run_dir, measure_prompts=PROMPTS, max_new_tokens=NEW, timeout=1500,
                      apply_fix=False, engine_probes=probes, validation=VALIDATION)
    print(f"[nextn probes] investigate --engine-probes {probes}: {time.monotonic() - t0:.1f} s; verdict "
          f"{doc.verdict}; {doc.sentence}")
    return doc


def _probes(doc) -> dict:
    return {p["probe"]: p for p in doc.engine_state["probes"]}


def test_clean_head_every_cheap_probe_clear_and_the_served_head_matches(served):
    url, arm, tmp = served
    assert not arm.exists()
    doc = _investigate(url, tmp / "run-clean", "cheap")
    p = _probes(doc)
    for name in ("served_draft", "step_trace", "radix_hit", "sampled_verify"):
        assert p[name]["status"] == "ran" and p[name]["decision"] == "clear", p[name]
    assert p["step_trace"]["evidence"]["mtp"]["use"] == "offline head"
    assert p["radix_hit"]["loss"]["delta"] == 0 and p["radix_hit"]["evidence"]["cached_tokens"]["prompts_with_hit"]
    b = doc.acceptance
    assert b["cause"] == "none" and b["losses"]["engine"]["decision"] == "clear", b["sentence"]
    parts = {r["part"]: r["decision"] for r in b["losses"]["engine"]["parts"]}
    assert parts["draft computation"] == parts["served weights"] == parts["cache state"] == "clear", parts
    assert doc.verdict == "ok" and doc.findings == []
    t0 = time.monotonic()
    check = check_draft(url, run_dir=tmp / "check", timeout=600)
    print(f"[nextn probes] --check-draft: {time.monotonic() - t0:.1f} s; {check['verdict']}: {check['reason']}")
    assert check["verdict"] == "matches" and check["exit"] == 0, check["reason"]


def test_a_verify_fault_is_named_in_the_heads_engine_stage(served):
    url, arm, tmp = served
    arm.write_text("armed by test_nextn_probes_server\n")
    try:
        doc = _investigate(url, tmp / "run-armed", "all")
    finally:
        arm.unlink()
    p = _probes(doc)
    assert p["oracle"]["status"] == "skipped" and "MTP / NextN head" in p["oracle"]["why"], p["oracle"]
    gl = p["greedy_lossless"]
    assert gl["status"] == "ran" and gl["decision"] == "counts", gl
    assert [f["kind"] for f in gl["findings"]] == ["speculation_not_lossless"]
    b = doc.acceptance
    e = b["losses"]["engine"]
    assert e["probe"] == "greedy_lossless" and e["decision"] == "undecided", e
    parts = {r["part"]: r["decision"] for r in e["parts"]}
    assert parts["verification"] == "counts", parts
    assert "speculation_not_lossless" in [f.kind for f in doc.findings] and doc.verdict == "mismatch"
