"""The acceptance budget on live embedded servers started with faults *after* the capture point, which no aux hidden
state shows and the tool is not told about: a damaged draft checkpoint, a wrong d2t, low speculative settings and a
draft-side forward hook that makes the engine compute the draft differently. Each must be put at its stage (``draft``,
``draft``, ``settings``, ``engine``); a generated topk > 1 tree (``support.faultgen``) must be replayed offline exactly
as the server verified it (no engine loss); the clean server (``none``, simulation within 0.1 of live) and the wiring fault
(``wiring``, the fix run offline, kept and measured) are checked in test_investigate_live.py on the servers it starts
anyway.

TP 1 servers (the budget does not depend on TP), one at a time (2 cores), ``--no-apply`` (nothing to restart)."""
from __future__ import annotations

import json

import pytest

from helpers.acceptance.prompts import load_prompts
from helpers.budget import Budget
from helpers.engines.detect import detect
from helpers.investigation.attach import attach
from helpers.investigation.live import investigate
from helpers.investigation.probes import ProbeContext, _one
from helpers.investigation.probes.sampled import SAMPLED_VERIFY
from support.drafts import damaged_draft, wrong_d2t_draft
from support.engine_faults import spec as engine_fault
from support.faultgen import draw
from support.verify_faults import spec as verify_fault
from test_investigate_live import MODELS, TRAINING, server  # noqa: F401  (registry fixture is autouse there)
from test_investigate_live import registry  # noqa: F401

pytestmark = pytest.mark.server


def _stage(doc, name):
    return next(s for s in doc.acceptance["stages"] if s["name"] == name)


def _run(tmp_path, url, **kw):
    return investigate(url, training=TRAINING, run_dir=tmp_path / "run", apply_fix=False, measure_prompts=12,
                       max_new_tokens=32, **kw)


def test_damaged_draft_is_put_at_the_draft_stage(tmp_path):
    draft = damaged_draft(tmp_path / "damaged", noise=2.0)
    with server(tmp_path, draft=draft, tp=1, capture=False) as url:
        doc = _run(tmp_path, url)
    b = doc.acceptance
    assert b["cause"] == "draft", b["sentence"]
    kinds = [f.kind for f in doc.findings]
    assert kinds == ["draft_underperforms"], kinds                # the wiring is right: nothing else is named
    loss = b["losses"]["draft"]
    assert loss["counts"] and loss["delta"] > 0.5 and loss["ci"][0] > 0, loss
    # the offline run on the served states predicts the live counters of the same requests: no engine loss
    assert abs(_stage(doc, "offline on live prompts' served states")["accept_length"]
               - _stage(doc, "live")["accept_length"]) <= 0.1
    assert doc.verdict == "mismatch" and "Cause: draft" in doc.sentence


def test_wrong_d2t_is_put_at_the_draft_stage(tmp_path):
    draft = wrong_d2t_draft(tmp_path / "d2t")
    with server(tmp_path, draft=draft, tp=1, capture=False) as url:
        doc = _run(tmp_path, url)
    b = doc.acceptance
    assert b["cause"] == "draft", b["sentence"]
    assert _stage(doc, "offline on training states")["accept_length"] < 1.2        # hardly a draft token right
    assert _stage(doc, "live")["accept_length"] < 1.2


def test_low_steps_are_put_at_the_settings_stage_with_the_recommended_steps(tmp_path):
    with server(tmp_path, "--steps", "1", "--topk", "1", "--draft-tokens", "2", tp=1, capture=False) as url:
        doc = _run(tmp_path, url)
    b = doc.acceptance
    assert b["settings"] == {"steps": 1, "topk": 1, "draft_tokens": 2}
    assert b["cause"] == "settings", b["sentence"]
    rec = b["recommended_settings"]
    assert rec["steps"] >= 2 and rec["draft_tokens"] == rec["steps"] + 1, rec
    assert f"--speculative-num-steps {rec['steps']}" in doc.sentence
    table = {t["steps"]: t["accept_length"] for t in b["settings_table"]}
    assert table[rec["steps"]] > table[1] + 0.5, table
    assert [f.kind for f in doc.findings] == ["spec_settings_low"]


def test_draft_side_hook_is_put_at_the_engine_stage(tmp_path):
    hook = [{"name": "draft-fc-noise", "target_modules": ["model.fc"], "hook_factory": "helpers.hooks:perturb_factory",
             "config": {"noise": 1.0, "seed": 0}}]
    with server(tmp_path, "--forward-hooks", json.dumps(hook), tp=1, capture=False) as url:
        doc = _run(tmp_path, url)
    b = doc.acceptance
    assert b["cause"] == "engine", b["sentence"]
    loss = b["losses"]["engine"]
    assert loss["delta"] > 0.3 and loss["ci"][0] > 0, loss
    # the wiring is right and the draft checkpoint is fine: those stages lose nothing material
    assert not b["losses"]["wiring"]["counts"] and not b["losses"]["draft"]["counts"]
    assert "engine_after_capture" in [f.kind for f in doc.findings]


def test_generated_tree_settings_are_replayed_as_the_server_verifies_them(tmp_path):
    """A generated settings fault with a topk > 1 tree of three levels (support.faultgen; the k x k beam, the top N-1
    tree): the offline replay on the served states of the live answers predicts the server's own counters for them, so
    the engine stage loses nothing; whether a chain would be faster is the settings stage's (cost model) to say: the
    cause is ``settings`` or ``none``, never another stage."""
    f = next(g for g in (draw(s, "settings") for s in range(100)) if g.params["settings"][1] > 1
             and g.params["settings"][0] >= 3)
    steps, topk, n = f.settings
    with server(tmp_path, *f.server_args(), tp=1, capture=False) as url:
        doc = _run(tmp_path, url)
    b = doc.acceptance
    assert b["settings"] == {"steps": steps, "topk": topk, "draft_tokens": n}, b["settings"]
    sim, live = _stage(doc, "offline on live prompts' served states"), _stage(doc, "live")
    assert abs(sim["accept_length"] - live["accept_length"]) <= 0.05, (sim, live)
    assert b["losses"]["engine"]["decision"] == "clear", b["losses"]["engine"]
    assert b["cause"] in ("settings", "none"), b["sentence"]
    assert any((t["steps"], t["topk"], t["draft_tokens"]) == (steps, topk, n) for t in b["settings_table"])


def test_stale_draft_kv_after_a_prefix_hit_is_named_by_the_radix_probe(tmp_path):
    """An engine-state fault a cold probe never sees (support.engine_faults: after the draft's prefill extend of a
    request whose prefix was in the KV, the draft's KV of those slots is noise, as a cache restore that brought back
    only the target's KV): every stage of the cold budget clears, the radix-hit probe (run by default) measures the
    loss on the same prompts with their prefix cached, and the budget's engine stage and the finding say so.

    The same server also runs the sampled-verify fault (support.verify_faults: at T > 0 a draft is accepted only if
    an independent sample of the target equals it), off until its arm file exists: unarmed, the sampled_verify probe
    (cold requests: the stale-KV fault never acts) is an exact identity, clear; armed, the probe alone counts the
    loss the greedy budget cannot see."""
    arm = tmp_path / "ARM_SAMPLED_VERIFY"
    hook = [engine_fault("draft_kv_stale", strength=1.0, seed=5), verify_fault(str(arm), strength=1.0, seed=3)]
    with server(tmp_path, "--forward-hooks", json.dumps(hook), tp=1, capture=False) as url:
        doc = _run(tmp_path, url)
        es = {p["probe"]: p for p in doc.engine_state["probes"]}
        sv = es["sampled_verify"]
        assert sv["status"] == "ran" and sv["decision"] == "clear", sv
        assert sv["evidence"]["exact_prompts"] == sv["evidence"]["paired"] == 12, sv["evidence"]
        assert sv["loss"]["delta"] == 0 and sv["findings"] == []
        arm.write_text("armed by test_budget_live\n")
        ad = detect(url, None, deadline_s=30).adapter
        client = ad.client(url, None, timeout=120, budget=Budget(600))
        try:
            att = attach(client, caveats=ad.capture_caveats)
            ctx = ProbeContext(client=client, adapter=ad, att=att, run_dir=tmp_path / "armed",
                               prompts=load_prompts(None, n=12), max_new_tokens=32, dl=Budget(600))
            armed = _one(SAMPLED_VERIFY, ctx, "cheap").to_json()
        finally:
            client.close()
    assert armed["decision"] == "counts" and armed["loss"]["delta"] > 0.5 and armed["loss"]["ci"][0] > 0, armed
    ev = armed["evidence"]
    assert ev["live_accept_length"] < ev["offline_accept_length"] - 0.5, ev
    assert [f["kind"] for f in armed["findings"]] == ["sampled_verify_loses_acceptance"]
    r = es["radix_hit"]
    assert r["decision"] == "counts" and r["loss"]["delta"] > 0.5 and r["loss"]["ci"][0] > 0, r
    assert r["evidence"]["cold_arm"].startswith("the acceptance budget's live answers")
    b = doc.acceptance
    assert b["cause"] == "engine", b["sentence"]
    e = b["losses"]["engine"]
    assert e["probe"] == "radix_hit" and e["on_server"]
    assert e["cold"]["decision"] != "counts", e["cold"]            # cold, the engine computes the draft as offline
    assert [f.kind for f in doc.findings] == ["cache_state_loses_acceptance"], [f.kind for f in doc.findings]
    assert "radix cache" in doc.sentence and doc.verdict == "mismatch"
