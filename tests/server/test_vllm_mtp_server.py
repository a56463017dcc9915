"""An MTP head on the embedded vLLM 0.32.0 CPU server (``--speculative-config {"method": "mtp"}``; extended tier, one
server start): the MiMo pair of env/models/make_mimo_pair.py (vLLM's CPU backend cannot run the Kimi-class target's
MLA: helpers/engines/vllm_mtp.py). ``investigate`` attaches (the worker extension's describe: MiMoMTP, method mtp,
the target's embedding and lm_head), identifies the served state as vLLM's rule for this head (``out(7)``, before the
final norm), the head offline on the served states accepts what the live counters count (engine loss 0), and the
trained head (env/models/llama_h64/mimo_mtp, its nextn_training_log.json and validation rows in the pair folder)
performs as its log says: the draft stage is decided, clear, and a clean server is ``ok``."""
from __future__ import annotations

import time

import pytest

from helpers.engines import vllm_server
from support import ROOT, import_from

# 275 s at load ~16 on 2 cores: the pair build, one vLLM start (220 s), investigate 11 s
pytestmark = pytest.mark.extended

PROMPTS, NEW = 8, 32


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    pair = tmp_path_factory.mktemp("mimo")
    import_from(ROOT / "env" / "models", "make_mimo_pair").build(pair)
    t0 = time.monotonic()
    h = vllm_server.start(pair, None, tp=1, num_speculative_tokens=1, mtp=True, timeout=1200)
    print(f"\n[vllm mtp] server ready in {time.monotonic() - t0:.1f} s")
    try:
        from helpers.investigation.live import investigate
        t0 = time.monotonic()
        doc = investigate(h.url, training=None, run_dir=tmp_path_factory.mktemp("run"), measure_prompts=PROMPTS,
                          max_new_tokens=NEW, timeout=900, apply_fix=False, engine_probes="none")
        print(f"[vllm mtp] investigate: {time.monotonic() - t0:.1f} s; verdict {doc.verdict}; {doc.sentence}")
        yield h, doc
    finally:
        h.stop()


def test_served_state_is_vllms_pre_norm_rule_and_live_equals_offline(served):
    _, doc = served
    ident = doc.diagnosis["served_state"]
    assert ident["expected"] == "out(7)" and ident["matches"] and ident["engine"] == "vLLM"
    assert ident["rel_error"]["out(7)"] < 1e-5 < 0.2 < ident["rel_error"]["norm(out(n-1))"]
    assert not [f for f in doc.findings if f.kind in ("norm_mismatch", "wrong_layer", "unidentified_chunk")]
    stages = {s["name"]: s for s in doc.acceptance["stages"]}
    live, wiring = stages["live"]["accept_length"], stages["wiring (offline, served states)"]["accept_length"]
    assert live > 1.2                                         # the trained head drafts, not chance
    assert abs(live - wiring) < 0.02
    assert doc.acceptance["losses"]["engine"]["decision"] == "clear"
    # the trained head's log and its own rows: the draft stage is decided (checkpoint = log on the log's rows)
    ck = stages["checkpoint (teacher-forced)"]
    log = doc.acceptance["draft_stage"]
    assert log["same_rows"] and log["log"].endswith("nextn_training_log.json")
    assert abs(ck["accept_length"] - ck["log_accept_length"]) < 2e-3
    assert doc.acceptance["losses"]["draft"]["decision"] == "clear"
    assert doc.verdict == "ok", (doc.verdict, doc.sentence)
