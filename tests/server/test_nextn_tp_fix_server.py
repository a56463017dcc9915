"""The NextN (MTP) investigation at TP 2 and its fix relaunched, on live SGLang 0.5.23 NEXTN servers of the Kimi-class
target (extended tier; two server starts, one at a time, each by ``server start --detach`` so that the registry holds
its launch and ``investigate`` can restart it):

* TP 2, 3 steps (the head is trained for 1), the ``tp_partial_sum`` hook (helpers.hooks) on the target's logits
  processor: each rank's head reads its own un-reduced share of out(7). ``/generate`` returns rank 0's share, which
  is none of the target's tensors; the every-layer capture of both ranks shows the sum is out(7): finding
  ``tp_partial_sum``. Its fix is in the engine's capture path: proposed only, never relaunched, though the steps
  finding stands beside it with its offline proof.
* TP 1, 3 steps, clean: ``mtp_steps_beyond_head``; the fix (``--speculative-num-steps 1``) is proven offline and
  measured after a restart: the fixed server serves 1 step, accepts fewer tokens per verify step (paired CI) and
  its steps finding is gone.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from helpers.server.process import stop_pid
from support import ROOT
from support.mtp_faults import TARGET, VALIDATION

pytestmark = pytest.mark.extended

PROMPTS, NEW = 12, 24


@pytest.fixture(scope="module", autouse=True)
def registry(tmp_path_factory):
    """State files of these servers go to a temporary folder, not outputs/servers."""
    if not (ROOT / "env" / "reference" / ".venv" / "bin" / "python").exists():
        pytest.skip("the SGLang reference environment is not installed (env/reference/install.sh)")
    if not (TARGET / "nextn_training_log.json").is_file() or not VALIDATION.is_dir():
        pytest.skip("the Kimi-class target's NextN head or its validation rows are not built here")
    path = tmp_path_factory.mktemp("registry")
    old = os.environ.get("E3F_SERVER_REGISTRY")
    os.environ["E3F_SERVER_REGISTRY"] = str(path)
    yield path
    if old is None:
        os.environ.pop("E3F_SERVER_REGISTRY", None)
    else:
        os.environ["E3F_SERVER_REGISTRY"] = old


@contextmanager
def _server(tmp: Path, tp: int, *args: str):
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "helpers", "server", "start", "--target", str(TARGET), "--nextn",
                          "--tp", str(tp), "--steps", "3", "--detach", "--timeout", "1200", "--capture-layers",
                          str(tmp / "layers"), *args], cwd=ROOT, capture_output=True, text=True, timeout=1500,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-3000:]
    url = re.search(r"ready: (http://127\.0\.0\.1:\d+)", out.stdout).group(1)
    pid = int(re.search(r"\(pid (\d+)", out.stdout).group(1))
    print(f"\n[nextn tp/fix] TP {tp} NEXTN server {args} ready in {time.monotonic() - t0:.1f} s")
    try:
        yield url
    finally:
        stop_pid(pid)


def _investigate(url, run_dir):
    from helpers.investigation.live import investigate
    t0 = time.monotonic()
    doc = investigate(url, training=None, run_dir=run_dir, measure_prompts=PROMPTS, max_new_tokens=NEW, timeout=1500,
                      engine_probes="none", validation=VALIDATION)
    print(f"[nextn tp/fix] investigate: {time.monotonic() - t0:.1f} s; verdict {doc.verdict}; {doc.sentence[:400]}")
    return doc


@pytest.fixture(scope="module")
def tp2_partial(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tp2")
    with _server(tmp, 2, "--faults", '[{"kind": "tp_partial_sum", "chunk": 0, "layer": 7}]') as url:
        yield _investigate(url, tmp / "run")


def test_tp2_partial_sum_named_across_ranks_and_its_fix_only_proposed(tp2_partial):
    doc = tp2_partial
    kinds = [f.kind for f in doc.findings]
    assert doc.verdict == "mismatch" and doc.error is None and kinds[0] == "tp_partial_sum", kinds
    assert "unidentified_chunk" not in kinds and "mtp_steps_beyond_head" in kinds
    ranks = doc.diagnosis["ranks"]
    assert ranks["tp"] == 2 and not ranks["ranks_agree"]
    assert all(i["identified"] is None for i in ranks["per_rank"].values())          # neither share is a tensor
    assert ranks["sum"]["identified"] == "out(7)" and ranks["sum"]["best_rel_error"] < 1e-4
    assert doc.diagnosis["served_state"]["identified"] is None                       # rank 0 alone: unexplained
    fix = doc.proposed_fix
    assert fix.kind == "engine" and not fix.applicable and fix.unaddressed == ["mtp_steps_beyond_head"]
    assert "capture path" in doc.measured["not_measured"]
    proof = doc.acceptance["steps_fix_offline"]
    assert proof["served"]["steps"] == 3 and proof["trained"]["steps"] == 1 and proof["n"] == PROMPTS


@pytest.fixture(scope="module")
def tp1_steps(tmp_path_factory, tp2_partial):          # after the TP 2 server: never two servers at once
    tmp = tmp_path_factory.mktemp("tp1")
    with _server(tmp, 1) as url:
        yield _investigate(url, tmp / "run")


def test_tp1_steps_fix_proven_offline_and_measured_after_a_restart(tp1_steps):
    doc = tp1_steps
    kinds = [f.kind for f in doc.findings]
    assert kinds == ["mtp_steps_beyond_head"] and doc.error is None
    fix = doc.proposed_fix
    assert fix.applicable and fix.server_args == {"--speculative-num-steps": 1, "--speculative-eagle-topk": 1,
                                                  "--speculative-num-draft-tokens": 2}
    proof = doc.acceptance["fix_offline"]
    assert proof["served"]["accept_length"] > proof["trained"]["accept_length"]     # 3 steps accept more per step
    assert proof["delta_ci"][1] < 0 and 0.2 < proof["cost"] < 0.8
    m = doc.measured
    assert m["before"]["num_steps"] == 3 and m["after"]["num_steps"] == 1 and m["fixed_server"]["steps"] == 1
    assert m["after_findings"] == [] and m["after_verdict"] == "ok"
    e = m["effect"]
    assert e["n_paired"] == PROMPTS and e["accept_length_delta_hi"] < 0                # fewer per verify step, paired
    # the live before / after follow the offline replay of the same head within the CIs
    assert m["before"]["accept_length_lo"] - 0.05 <= proof["served"]["accept_length"] <= \
        m["before"]["accept_length_hi"] + 0.05
    assert m["after"]["accept_length_lo"] - 0.05 <= proof["trained"]["accept_length"] <= \
        m["after"]["accept_length_hi"] + 0.05
    mc = m["measured_cost"]
    assert mc is not None and mc["q"] > 0
    print(f"[nextn tp/fix] before {m['before']['accept_length']:.2f} @ {m['before']['tok_s']:.1f} tok/s, after "
          f"{m['after']['accept_length']:.2f} @ {m['after']['tok_s']:.1f} tok/s; measured cost {mc}")
