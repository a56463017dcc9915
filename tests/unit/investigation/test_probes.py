"""The engine-state probes without a server: the radix-hit probe against a fake engine whose prefix cache and
acceptance the test controls, the losslessness classification, the probes' skips, and how their results join the
acceptance budget's engine stage."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest

from helpers.acceptance.prompts import load_prompts
from helpers.budget import Budget
from helpers.engines.sglang import SGLangAdapter
from helpers.draft.budget import _loss, budget_sentence
from helpers.engines.sglang import SGLangAdapter
from helpers.errors import BadInput
from helpers.investigation.probes import (ProbeContext, check_choice, join_engine_state, probe_line, probes,
                                          run_probes)
from helpers.draft.budget import engine_parts_text
from helpers.investigation.probes import ENGINE_PARTS
from helpers.investigation.probes.parts import COLD, engine_parts
from helpers.views.budget import ladder_frame, losses_frame
from helpers.investigation.probes.lossless import NEAR_TIE, classify, first_divergence, top2
from helpers.server.protocol import GenerateResult


class FakeEngine:
    """A greedy engine with a prefix cache: a prompt sent before (since the last flush) is a hit
    (``cached_tokens`` = its length - 1). ``accepted(prompt_index, hit)`` gives the accepted drafts per verify step
    of each answer (3 draft tokens per step, ``max_new_tokens`` tokens per answer)."""

    def __init__(self, accepted, *, tokens_per_prompt=12):
        self.accepted, self.n = accepted, tokens_per_prompt
        self.cache: set = set()
        self.calls: list = []
        self.timeout = 5.0

    def server_info(self, refresh=False):
        return {"disable_radix_cache": False, "speculative_algorithm": "EAGLE3"}

    def flush_cache(self):
        self.cache.clear()

    def generate(self, text=None, input_ids=None, sampling_params=None, max_new_tokens=None, **kw):
        max_new_tokens = max_new_tokens or (sampling_params or {}).get("max_new_tokens")
        key = text if text is not None else tuple(input_ids)
        hit = key in self.cache
        self.cache.add(key)
        self.calls.append((key, max_new_tokens, hit))
        i = int(str(key).split("|")[0]) if "|" in str(key) else 0
        if max_new_tokens < 2:
            meta = {"prompt_tokens": self.n, "completion_tokens": 1, "cached_tokens": self.n - 1 if hit else 0}
            return GenerateResult.model_validate({"output_ids": [1], "meta_info": meta, "latency_s": 0.01})
        a = self.accepted(i, hit)                     # accepted drafts per verify step
        steps = -(-(max_new_tokens - 1) // (a + 1))  # first token from prefill, then a + 1 per verify step
        meta = {"prompt_tokens": self.n, "completion_tokens": 1 + steps * (a + 1),
                "cached_tokens": self.n - 1 if hit else 0, "spec_verify_ct": steps,
                "spec_num_correct_drafts": steps * a, "spec_num_proposed_drafts": steps * 3,
                "spec_accept_length": (1 + steps * (a + 1)) / steps}
        return GenerateResult.model_validate({"output_ids": list(range(1 + steps * (a + 1))), "meta_info": meta,
                                              "latency_s": 0.01})


#: the adapter methods the probes call whose answers are SGLang's (no prefix-hit rule, no trace refusal)
SGLANG_LIKE = {"prefix_cache_off": SGLangAdapter().prefix_cache_off, "prefix_hit_tokens": lambda info, n: None,
               "top_logprobs_fields": SGLangAdapter().top_logprobs_fields,
               "trace_unavailable": SGLangAdapter().trace_unavailable}


def _no_host_tier(info, **kw):
    return None, "fake: no host tier"          # the host-tier probe: tests/unit/investigation/test_hicache_probe.py


def _prompts(n):
    return load_prompts([{"id": f"p{i}", "text": f"{i}|prompt {i}"} for i in range(n)])


def _ctx(tmp_path: Path, engine, n=12, restart=None, timeout=600.0) -> ProbeContext:
    return ProbeContext(client=engine, adapter=SimpleNamespace(chunked_prefill_flags=lambda t: None, label="fake",
                                                               oracle_flags=lambda: None, **SGLANG_LIKE,
                                                               integrity_launch=lambda s: None,
                                                               host_cache_launch=_no_host_tier),
                        att=SimpleNamespace(restart=restart), run_dir=tmp_path, prompts=_prompts(n),
                        max_new_tokens=25, dl=Budget(timeout))


def test_radix_hit_clear_on_an_engine_whose_hits_accept_the_same(tmp_path):
    eng = FakeEngine(lambda i, hit: 1 + i % 3)
    st = run_probes(_ctx(tmp_path, eng), "cheap")
    r = {p["probe"]: p for p in st["probes"]}["radix_hit"]
    assert r["status"] == "ran" and r["decision"] == "clear"
    assert r["loss"]["delta"] == 0 and r["findings"] == []
    assert r["evidence"]["cached_tokens"]["prompts_with_hit"] == 12
    # each prompt: one cold answer (flushed), one 1-token fill, one measured hit
    assert sum(1 for _, m, hit in eng.calls if m == 25 and hit) == 12
    assert (tmp_path / "engine_state" / "radix_hit" / "radix_hit.parquet").exists()


def test_radix_hit_counts_when_hits_lose_accepted_drafts(tmp_path):
    eng = FakeEngine(lambda i, hit: (0 if hit else 2) if i % 4 else 2)
    st = run_probes(_ctx(tmp_path, eng), "cheap")
    r = {p["probe"]: p for p in st["probes"]}["radix_hit"]
    assert r["decision"] == "counts"
    assert r["loss"]["delta"] > 1.0 and r["loss"]["ci"][0] > 0
    (f,) = r["findings"]
    assert f["kind"] == "cache_state_loses_acceptance" and f["evidence"]["condition"] == "radix_hit"
    assert st["findings"] == r["findings"]


def test_radix_hit_without_a_cached_token_is_no_evidence(tmp_path):
    eng = FakeEngine(lambda i, hit: 2)
    eng.generate_orig = eng.generate

    def no_cache(**kw):
        eng.cache.clear()                               # an engine that never keeps a prefix
        return eng.generate_orig(**kw)
    eng.generate = no_cache
    r = {p["probe"]: p for p in run_probes(_ctx(tmp_path, eng), "cheap")["probes"]}["radix_hit"]
    assert r["decision"] == "undecided" and "cached_tokens 0" in r["loss"]["settle"]["text"]


def test_repeatable_notes_a_server_whose_greedy_answers_move(tmp_path):
    st = run_probes(_ctx(tmp_path, FakeEngine(lambda i, hit: 2)), "cheap")
    r = {p["probe"]: p for p in st["probes"]}["repeatable"]
    assert r["evidence"]["same"] is True and r["why"] is None and st["notes"] == []
    calls = iter(range(100))
    eng = FakeEngine(lambda i, hit: 1 + next(calls) % 2)           # another accept count on every call
    st = run_probes(_ctx(tmp_path, eng), "cheap")
    r = {p["probe"]: p for p in st["probes"]}["repeatable"]
    assert r["evidence"]["same"] is False and r["decision"] is None
    assert any("differently on call 2" in n for n in st["notes"])


def test_restart_probes_skip_with_why(tmp_path):
    st = run_probes(_ctx(tmp_path, FakeEngine(lambda i, h: 2)), "cheap")
    skipped = {p["probe"]: p["why"] for p in st["probes"] if p["status"] == "skipped"}
    assert {"chunked_prefill", "greedy_lossless", "oracle"} <= set(skipped)
    assert all("--engine-probes all" in skipped[k] for k in ("chunked_prefill", "greedy_lossless", "oracle"))
    assert all("--trace-draft" in skipped[k] for k in ("served_draft", "step_trace"))   # no trace hook here
    st = run_probes(_ctx(tmp_path, FakeEngine(lambda i, h: 2)), "all")
    why = {p["probe"]: p["why"] for p in st["probes"] if p["status"] == "skipped"}
    assert "cannot be restarted" in why["greedy_lossless"] and "cannot be restarted" in why["chunked_prefill"]
    st = run_probes(_ctx(tmp_path, FakeEngine(lambda i, h: 2), restart={"kind": "embedded"}, timeout=70.0), "all")
    why = {p["probe"]: p["why"] for p in st["probes"] if p["status"] == "skipped"}
    assert "chunked-prefill flag was not read" in why["chunked_prefill"]
    assert why["hicache_hit"] == "fake: no host tier"                  # the adapter's own reason
    assert "self-drafting algorithm was not read" in why["oracle"]
    assert "left of the run" in why["greedy_lossless"]
    costs = [p.cost for p in probes()]
    assert costs == sorted(costs, key=lambda c: c != "cheap") and costs.count("restart") == 6     # cheap first
    lines = {p["probe"]: probe_line(p) for p in st["probes"]}
    assert lines["oracle"].startswith("oracle (with a perfect draft") and "skipped: " in lines["oracle"]
    assert lines["radix_hit"].startswith("radix_hit (with the prompt's prefix in the radix cache): ")


def test_engine_probes_choice_is_checked():
    assert check_choice("all") == "all"
    with pytest.raises(BadInput, match="--engine-probes"):
        check_choice("some")


def test_first_divergence_and_near_ties():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2
    meta = {"output_top_logprobs": [[[-0.1, 7, None], [-2.0, 9, None]], [[-0.693, 4, None], [-0.695, 8, None]]]}
    assert top2(meta, 1) == [(-0.693, 4), (-0.695, 8)] and top2(meta, 5) is None and top2({}, 0) is None
    tie = classify([7, 8], [7, 4], top2(meta, 1), 1)
    assert tie["near_tie"] is True and tie["margin"] == pytest.approx(0.002) and tie["margin"] < NEAR_TIE
    real = classify([9, 4], [7, 4], top2(meta, 0), 0)
    assert real["near_tie"] is False and real["margin"] == pytest.approx(1.9)
    outside = classify([3, 4], [7, 4], top2(meta, 0), 0)        # not even the runner-up
    assert outside["near_tie"] is False and outside["margin"] is None
    assert classify([3], [7], None, 0)["near_tie"] is None


def _budget(engine_delta, engine_lo, engine_hi, n=16):
    per = [engine_delta] * n
    losses = {s: _loss(s, 0.0, -0.02, 0.02, "x", 3.0, n=n, per_sequence=[0.0] * n)
              for s in ("draft", "wiring", "settings")}
    losses["engine"] = _loss("engine", engine_delta, engine_lo, engine_hi, "sim - live", 3.0, n=n, unit="prompts",
                             per_sequence=per)
    b = {"stages": [{"name": "live", "accept_length": 2.7}], "losses": losses}
    from helpers.draft.budget import cause_of
    b["cause"] = cause_of(losses)
    b["sentence"] = budget_sentence(b)
    return b


def _probe(name, decision, delta=None, ci=(None, None), n=16):
    loss = None if delta is None else _loss(name, delta, ci[0], ci[1], f"{name} basis", 2.7, n=n, unit="prompts")
    return {"probe": name, "cost": "cheap", "condition": f"in condition {name}", "status": "ran",
            "decision": decision if loss is None else loss["decision"], "loss": loss, "findings": []}


def test_join_engine_state_a_counted_probe_is_the_engine_loss():
    b = _budget(0.0, -0.01, 0.01)
    assert b["cause"] == "none"
    out = join_engine_state(b, {"probes": [_probe("radix_hit", "counts", 1.0, (0.85, 1.15))]})
    assert out["cause"] == "engine"
    e = out["losses"]["engine"]
    assert e["probe"] == "radix_hit" and e["on_server"] and e["delta"] == 1.0
    assert e["cold"]["decision"] == "clear"
    assert "in condition radix_hit" in out["sentence"]


def test_join_engine_state_an_undecided_probe_keeps_the_engine_stage_open():
    b = _budget(0.0, -0.01, 0.01)
    out = join_engine_state(b, {"probes": [_probe("radix_hit", "undecided", 0.12, (-0.2, 0.4))]})
    assert out["cause"] == "undecided" and out["losses"]["engine"]["decision"] == "undecided"
    assert "radix_hit" in out["losses"]["engine"]["settle"]["text"]


def test_join_engine_state_a_clear_probe_changes_nothing_and_a_larger_cold_loss_stays():
    b = _budget(0.0, -0.01, 0.01)
    out = join_engine_state(b, {"probes": [_probe("radix_hit", "clear", 0.0, (0.0, 0.0))]})
    assert out["cause"] == "none" and "probe" not in out["losses"]["engine"]
    b = _budget(1.5, 1.3, 1.7)
    out = join_engine_state(b, {"probes": [_probe("radix_hit", "counts", 0.5, (0.3, 0.7))]})
    assert out["losses"]["engine"]["delta"] == 1.5 and "probe" not in out["losses"]["engine"]


def test_join_engine_state_a_lossless_fault_leaves_no_clear_engine_stage():
    b = _budget(0.0, -0.01, 0.01)
    out = join_engine_state(b, {"probes": [_probe("greedy_lossless", "counts")]})
    assert out["losses"]["engine"]["decision"] == "undecided" and out["cause"] == "undecided"
    assert join_engine_state(None, {"probes": []}) is None


def test_oracle_perfect_accept_length_and_losses():
    from helpers.investigation.probes.oracle import oracle_losses, perfect_accept_length
    # 32 tokens at steps 3: the prefill token, then 8 verify steps of up to 4 (the last cut to 3)
    assert perfect_accept_length(32, 3) == 4.0
    assert perfect_accept_length(33, 3) == pytest.approx(33 / 8)
    assert perfect_accept_length(34, 3) == pytest.approx(34 / 9)
    frame = pd.DataFrame({"completion_tokens": [32, 32, 32], "verify_ct": [8, 9, None],
                          "error": [None, None, "boom"]})
    assert oracle_losses(frame, 3) == [0.0, pytest.approx(4.0 - 32 / 9)]


class FakeCopies:
    """An engine adapter whose restarted copies are fake engines the test gives per kind of copy (chunked prefill,
    the target alone, the oracle): the restart probes' own path (start, measure cold, stop) without a server."""

    label = "fake"
    prefix_cache_off = staticmethod(SGLANG_LIKE["prefix_cache_off"])
    prefix_hit_tokens = staticmethod(SGLANG_LIKE["prefix_hit_tokens"])
    top_logprobs_fields = staticmethod(SGLANG_LIKE["top_logprobs_fields"])
    trace_unavailable = staticmethod(SGLANG_LIKE["trace_unavailable"])

    def __init__(self, copies):
        self.copies, self.started, self.stopped = copies, [], 0

    def chunked_prefill_flags(self, tokens):
        return {"--chunked-prefill-size": str(tokens)}

    oracle_flags = staticmethod(SGLangAdapter().oracle_flags)        # the real adapter's flags and caveat
    oracle_caveat = staticmethod(SGLangAdapter().oracle_caveat)

    def integrity_launch(self, switch):
        return None                               # the integrity probes: tests/unit/investigation/test_integrity_probes.py

    host_cache_launch = staticmethod(_no_host_tier)

    def start_variant(self, restart, *, draft=None, keep_draft=True, flags=None, **kw):
        kind = "alone" if not keep_draft else "oracle" if (flags or {}).get("--speculative-algorithm") else "chunked"
        self.started.append((kind, dict(flags or {}), draft))

        def stop():
            self.stopped += 1
        return SimpleNamespace(url=f"fake://{kind}", stop=stop)

    def client(self, url, api_key=None, **kw):
        eng = self.copies[url.split("://")[1]]
        eng.close = lambda: None
        return eng


def test_restart_probes_measure_their_copies_and_stop_them(tmp_path):
    def alone_outputs(**kw):                      # the target alone: its greedy tokens differ at output 3 from i = 0
        res = FakeEngine(lambda i, hit: 2).generate(**kw)
        if kw.get("text", "").startswith("0|"):
            res.output_ids[3] = 999
            res.meta_info.__pydantic_extra__["output_top_logprobs"] = [[[-0.1, 7, None], [-3.0, 8, None]]] * 40
        return res
    alone = SimpleNamespace(flush_cache=lambda: None, generate=alone_outputs, timeout=5.0)
    copies = FakeCopies({"chunked": FakeEngine(lambda i, hit: 0 if i % 2 else 2),     # chunk borders lose drafts
                         "oracle": FakeEngine(lambda i, hit: 3), "alone": alone})
    ctx = _ctx(tmp_path, FakeEngine(lambda i, hit: 2), restart={"kind": "embedded"})
    ctx.adapter = copies
    ctx.att = SimpleNamespace(restart={"kind": "embedded"}, target_dir=tmp_path / "target",
                              spec={"num_steps": 3, "topk": 1})
    st = run_probes(ctx, "all")
    r = {p["probe"]: p for p in st["probes"]}
    assert [k for k, _, _ in copies.started] == ["chunked", "alone", "oracle"] and copies.stopped == 3
    assert copies.started[2][2] == tmp_path / "target"                         # the oracle drafts with the target
    # STANDALONE without the prefix cache (its radix keys are single tokens, its draft rows pairs): a switch
    assert copies.started[2][1] == {"--speculative-algorithm": "STANDALONE", "--disable-radix-cache": None}
    assert r["chunked_prefill"]["decision"] == "counts" and r["chunked_prefill"]["evidence"]["chunk_tokens"] >= 2
    assert r["chunked_prefill"]["findings"][0]["kind"] == "cache_state_loses_acceptance"
    assert r["greedy_lossless"]["decision"] == "counts", r["greedy_lossless"]
    (d,) = r["greedy_lossless"]["findings"][0]["evidence"]["divergences"]
    assert d["prompt_id"] == "p0" and d["position"] == 3 and d["margin"] is None and d["near_tie"] is False
    o = r["oracle"]
    assert o["status"] == "ran" and o["decision"] is None and "engine's floor" in o["why"]
    # the switch is named without a value, and SGLang's caveat (its STANDALONE draft runs on the rotated sequence)
    # is in the report: the floor is not verification's alone
    assert "STANDALONE, --disable-radix-cache: a floor" in o["why"] and "None" not in o["why"]
    assert o["evidence"]["engine_caveat"] == SGLangAdapter().oracle_caveat() and "rotated left by one" in o["why"]
    assert o["evidence"]["floor"]["delta"] == pytest.approx(0.0) and o["evidence"]["perfect_accept_length"] == pytest.approx(25 / 6)
    # the oracle is no stage loss: joined into a budget it changes nothing
    b = join_engine_state(_budget(0.0, -0.01, 0.01), {"probes": [o]})
    assert b["cause"] == "none"


# the engine stage's parts (verification, draft computation, served weights, cache state), each decided from the
# probes that ran on the fake engine (the real runner, the real paired loss), in the sentence, ladder and losses

def _parts(out):
    return {p["part"]: p for p in out["losses"]["engine"]["parts"]}


def test_a_cache_fault_counts_in_the_cache_part_and_nowhere_else(tmp_path):
    eng = FakeEngine(lambda i, hit: (0 if hit else 2) if i % 4 else 2)
    state = run_probes(_ctx(tmp_path, eng), "cheap")
    out = join_engine_state(_budget(0.0, -0.01, 0.01), state)
    parts = _parts(out)
    assert list(parts) == [COLD, *ENGINE_PARTS]
    assert parts[COLD]["decision"] == "clear"                       # the cold comparison, before the probe joined
    cache = parts["cache state"]
    assert cache["decision"] == "counts"
    assert cache["probes"] == ["radix_hit", "chunked_prefill", "hicache_hit", "kv_canary", "invariant_check"]
    assert cache["delta"] == out["losses"]["engine"]["delta"] > 1.0 and cache["ci"][0] > 0
    # nothing ran for the others: not measured, each saying why (no trace hooks, not asked for, no restart)
    for name in ("verification", "draft computation", "served weights"):
        assert parts[name]["decision"] == "not measured" and parts[name]["why"], name
    assert "not asked for" in parts["verification"]["why"] or "restarted" in parts["verification"]["why"]
    assert out["cause"] == "engine"
    assert "Engine parts: cold greedy clear; verification not measured" in out["sentence"]
    assert "cache state counts" in out["sentence"]


def test_clean_cache_is_clear_and_the_ladder_and_losses_show_every_part(tmp_path):
    eng = FakeEngine(lambda i, hit: 1 + i % 3)
    out = join_engine_state(_budget(0.0, -0.01, 0.01), run_probes(_ctx(tmp_path, eng), "cheap"))
    parts = _parts(out)
    assert parts["cache state"]["decision"] == "clear" and parts["cache state"]["delta"] == 0
    assert out["cause"] == "none"                 # not-measured parts say so; they do not reopen a clear stage
    lad = ladder_frame({**out, "stages": [{"name": "offline on live prompts' served states", "accept_length": 2.7},
                                          {"name": "live", "accept_length": 2.7}]})
    rows = lad[lad["stage"].str.startswith("engine: ")]
    assert list(rows["stage"]) == [f"engine: {p}" for p in ENGINE_PARTS]
    assert list(rows["decision"]) == ["not measured", "not measured", "not measured", "clear"]
    assert lad["stage"].tolist().index("engine: verification") == lad["stage"].tolist().index("live") + 1
    lf = losses_frame(out)
    assert set(lf["stage"]) >= {f"engine: {p}" for p in ENGINE_PARTS}
    row = lf.set_index("stage").loc["engine: cache state"]
    # a part cleared by radix_hit alone says so: it rests on radix_hit, the others of the part did not run (the
    # fresh-user run read "cache state clear" as every cache probe clear)
    assert row["basis"] == "radix_hit"
    assert row["what would settle it"] == "not run: chunked_prefill, hicache_hit, kv_canary, invariant_check"
    cache = parts["cache state"]
    assert cache["rests_on"] == ["radix_hit"] and "not run: chunked_prefill (not asked for" in cache["why"]
    assert ("cache state clear (radix_hit only; not run: chunked_prefill, hicache_hit, kv_canary, invariant_check)"
            in out["sentence"])


def test_a_part_is_undecided_from_an_undecided_probe_and_a_failed_probe_is_not_evidence():
    state = {"probes": [
        {"probe": "radix_hit", "part": "cache state", "condition": "hit", "status": "ran", "decision": "undecided",
         "loss": {"delta": 0.1, "ci": [-0.2, 0.4], "settle": {"text": "32 prompts"}}},
        {"probe": "greedy_lossless", "part": "verification", "condition": "alone", "status": "failed",
         "decision": None, "why": "the copy did not start"},
        {"probe": "oracle", "part": "verification", "condition": "perfect", "status": "ran", "decision": None,
         "evidence": {"oracle_accept_length": 3.66, "perfect_accept_length": 4.0,
                      "floor": {"delta": 0.32, "ci": [0.15, 0.49]}}}]}
    parts = {p["part"]: p for p in engine_parts(state, None)}
    assert COLD not in parts
    assert parts["cache state"]["decision"] == "undecided" and "32 prompts" in parts["cache state"]["why"]
    v = parts["verification"]
    assert v["decision"] == "not measured" and "the copy did not start" in v["why"]
    assert v["floor"] == {"probe": "oracle", "accept_length": 3.66, "perfect": 4.0, "lost": 0.32, "ci": [0.15, 0.49]}
    assert engine_parts_text(None) == "" and engine_parts_text([]) == ""


def test_the_headline_names_the_part_that_counts_and_an_ok_says_what_it_did_not_measure(tmp_path):
    from helpers.investigation.story import headline_parts
    from helpers.records import InvestigationDoc
    bad = join_engine_state(_budget(0.0, -0.01, 0.01), run_probes(_ctx(tmp_path / "a", FakeEngine(
        lambda i, hit: (0 if hit else 2) if i % 4 else 2)), "cheap"))
    text = headline_parts(InvestigationDoc(acceptance=bad, verdict="mismatch"))[0]["text"]
    assert text.startswith("acceptance is lost at the engine stage (cache state: radix_hit (")
    ok = join_engine_state(_budget(0.0, -0.01, 0.01), run_probes(_ctx(tmp_path / "b", FakeEngine(
        lambda i, hit: 2)), "cheap"))
    text = headline_parts(InvestigationDoc(acceptance=ok, verdict="ok"))[0]["text"]
    assert text.endswith("(engine parts not measured: verification, draft computation, served weights)")


def test_a_signal_during_the_probes_keeps_the_decisions_reached(tmp_path):
    """Ctrl-C during ``--engine-probes``: the probes that finished stay in ``ctx.extra[PARTIAL]`` with why the run
    stopped (an interrupted investigation saved ``engine_state: null`` and dropped four decisions)."""
    from helpers.errors import Interrupted
    from helpers.investigation.probes import PARTIAL
    ctx = _ctx(tmp_path, FakeEngine(lambda i, hit: 2))

    def ctrl_c_after_radix(line):
        if "radix_hit" in line:                # the signal lands once radix_hit has reported, before the next probe
            raise Interrupted(2)
    ctx.progress = ctrl_c_after_radix
    with pytest.raises(Interrupted):
        run_probes(ctx, "cheap")
    part = ctx.extra[PARTIAL]
    done = {p["probe"]: p for p in part["probes"]}
    assert done["radix_hit"]["decision"] == "clear" and done["repeatable"]["status"] == "ran"
    assert "Interrupted" in part["stopped"] and "sampled_verify" not in done


def test_an_unfinished_investigation_is_never_ok():
    """A run stopped after its diagnosis said ``ok`` is ``undecided`` (the budget and probes did not run), with the
    stage it stopped in; a ``mismatch`` keeps its findings' verdict."""
    from helpers.investigation.live import _unfinished, sentence
    from helpers.records import InvestigationDoc
    doc = InvestigationDoc(url="http://127.0.0.1:1", run_dir="r", training="t", verdict="ok",
                           error="interrupted by SIGINT")
    _unfinished(doc, "engine state")
    assert doc.verdict == "undecided" and "'engine state' stage" in doc.notes[-1]
    assert sentence(doc).startswith("The investigation did not finish: interrupted by SIGINT")
    doc = InvestigationDoc(url="http://127.0.0.1:1", run_dir="r", training="t", verdict="mismatch", error="x")
    _unfinished(doc, "acceptance budget")
    assert doc.verdict == "mismatch"
