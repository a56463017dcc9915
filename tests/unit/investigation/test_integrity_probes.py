"""The integrity-switch probes (``kv_canary``, ``invariant_check``) without a server: the log scan and the decision
on SGLang 0.5.23's own log text (tests/data/integrity/: excerpts of real embedded servers' logs, clean then with a
test-only fault armed), why they are skipped, the copy they start (flags and environment) and a copy that fails."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from helpers.acceptance.prompts import load_prompts
from helpers.budget import Budget
from helpers.engines.sglang import SGLangAdapter
from helpers.engines.vllm import VLLMAdapter
from helpers.errors import ServerStartError, ServerUnavailable
from helpers.investigation.probes import ProbeContext, run_probes
from helpers.investigation.probes.integrity import decide, last_error_line, scan_log
from helpers.server import restart as restart_mod
from tests.unit.investigation.test_probes import FakeEngine

DATA = Path(__file__).resolve().parents[2] / "data" / "integrity"


def _text(name: str) -> str:
    return (DATA / name).read_text()


def test_invariant_check_log_of_a_real_server_clean_then_faulty():
    text = _text("invariant_check.log")
    lines = text.splitlines()
    cut = next(i for i, ln in enumerate(lines) if "KV page use-after-free" in ln)
    clean = scan_log("\n".join(lines[:cut]), "invariant_check")
    assert clean["violations"] == [] and clean["live_lines"] >= 1
    decision, status, why = decide(clean, "invariant_check")
    assert (decision, status) == ("clear", "ran") and "fired nothing" in why and "DSpark" in why
    full = scan_log(text, "invariant_check")
    v = full["violations"][0]
    assert v["line"] == cut + 1 and v["message"].startswith("KV page use-after-free: ")
    assert v["fired_in"].endswith("SchedulerInvariantChecker._check_kv_page_invariants")
    assert v["rank"] in ("TP0", "TP1") and "[" not in v["message"][:3]
    decision, status, why = decide(full, "invariant_check")
    assert decision == "counts" and f"log line {cut + 1}" in why
    # a violation is a violation even when the copy then failed
    assert decide(full, "invariant_check", error="the copy exited")[0] == "counts"


def test_kv_canary_log_of_a_real_server_clean_then_faulty():
    # the embedded CPU server with the stand-in's test-only E3F_TEST_CANARY_CPU and the kv_bytes_overwrite fault
    text = _text("kv_canary.log")
    lines = text.splitlines()
    cut = next(i for i, ln in enumerate(lines) if "kv_canary violation:" in ln)
    clean = scan_log("\n".join(lines[:cut]), "kv_canary")
    assert clean["violations"] == [] and clean["live_lines"] == 5          # 4 at step 1 (24 tokens) + the draft's
    assert clean["live_first"]["message"].startswith("[canary] step=1 protected_tokens=24")
    assert decide(clean, "kv_canary")[0] == "clear"
    bad = scan_log(text, "kv_canary")
    first = bad["violations"][0]
    assert first["line"] == cut + 1 and first["rank"] == "TP1"
    assert first["message"].startswith("kv_canary violation: launch_tag=TAIL_K_FULL fail_reason=verify_real_kv_hash "
                                       "slot_idx=1 position=0")
    assert first["fired_in"].endswith("ViolationReporter.log_or_raise_violation")
    assert first["repeats"] == 2                          # the same line on TP1 again and on TP0: one quote
    counted = [v for v in bad["violations"] if v["message"].startswith("[canary]")]
    assert [(v["message"].split()[1], v["repeats"]) for v in counted] == [("step=67", 1)]   # TP1 and TP0
    assert bad["violation_lines"] == 5
    decision, _, why = decide(bad, "kv_canary")
    assert decision == "counts" and f"log line {cut + 1}" in why


def test_a_silent_log_is_no_proof_and_a_stalled_canary_is_undecided():
    quiet = scan_log("[2026-12-03 16:10:00 TP0] Load weight end.\n", "invariant_check")
    decision, status, why = decide(quiet, "invariant_check")
    assert decision == "undecided" and "liveness not shown on this build" in why
    stalled = scan_log("[2026-12-03 16:10:00 TP0] RuntimeError: kv-canary: kernel_run_counter did not increase since "
                       "previous check for tags=[TAIL_K_FULL] at step=64; canary path is not executing\n", "kv_canary")
    decision, _, why = decide(stalled, "kv_canary")
    assert decision == "undecided" and "installed but not running: log line 1" in why
    assert decide(quiet, "invariant_check", error="exited")[:2] == (None, "failed")


def test_last_error_line_skips_the_traceback_header():
    text = ("[2026-12-03 16:10:00 TP0] Scheduler hit an exception: Traceback (most recent call last):\n"
            '  File "canary_manager.py", line 91, in __init__\n'
            "TypeError: Stream.__init__() got an unexpected keyword argument 'device'\n"
            "[2026-12-03 16:10:01] Received sigquit from a child process.\n")
    assert last_error_line(text) == "TypeError: Stream.__init__() got an unexpected keyword argument 'device'"
    assert last_error_line("all well\n") is None


def test_why_each_engine_skips_or_runs_the_switches():
    sg, vl = SGLangAdapter(), VLLMAdapter()
    why = sg.integrity_refusal("kv_canary", {"device": "cpu"})
    assert "CPU server" in why and "create_device_stream" in why
    assert sg.integrity_refusal("kv_canary", {"device": "cuda"}) is None
    assert sg.integrity_refusal("invariant_check", {"device": "cpu"}) is None
    assert sg.integrity_launch("kv_canary")["flags"]["--kv-canary"] == "log"
    assert sg.integrity_launch("invariant_check")["env"]["SGLANG_INVARIANT_CHECK"] == "1"
    assert sg.integrity_launch("nope") is None
    assert vl.integrity_launch("kv_canary") is None and vl.integrity_launch("invariant_check") is None


class LogCopies:
    """An engine adapter (SGLang's flags and refusals) whose restarted copy is a fake engine and writes the given
    log text to the copy's log path; ``fail``: the start raises as a copy that exits does."""

    label = "SGLang"

    def __init__(self, log_text: str, fail: bool = False, device: str = "cpu", dead: bool = False):
        self.log_text, self.fail, self.device, self.dead = log_text, fail, device, dead
        self.started: list = []
        self.stopped = 0
        self._sg = SGLangAdapter()

    def __getattr__(self, name):                       # the other flags: none read
        if name.endswith("_flags"):
            return lambda *a: None
        if name in ("trace_unavailable", "prefix_cache_off", "prefix_hit_tokens", "top_logprobs_fields",
                    "sampled_verify_refusal", "verify_note"):
            return getattr(self._sg, name)                  # the other probes' answers: SGLang's
        raise AttributeError(name)

    def integrity_launch(self, switch):
        return self._sg.integrity_launch(switch)

    def host_cache_launch(self, info, **kw):           # the host-tier probe: test_hicache_probe.py
        return None, "not measured by these tests"

    def integrity_refusal(self, switch, info):
        return self._sg.integrity_refusal(switch, info)

    def start_variant(self, restart, *, log_path, flags=None, env=None, **kw):
        self.started.append((dict(flags or {}), dict(env or {})))
        Path(log_path).write_text(self.log_text)
        if self.fail:
            raise ServerStartError("the kv_canary copy exited with status 1", "", log_path)

        def stop():
            self.stopped += 1
        return SimpleNamespace(url="fake://copy", stop=stop)

    def client(self, url, api_key=None, **kw):
        eng = FakeEngine(lambda i, hit: 2)
        eng.close = lambda: None
        if self.dead:                                  # a copy whose scheduler died: every request refused

            def refuse(**kw):
                raise ServerUnavailable("POST /generate: connection refused")
            eng.generate = refuse
        return eng


def _ctx(tmp_path, adapter, device="cpu"):
    eng = FakeEngine(lambda i, hit: 2)
    eng.server_info = lambda refresh=False: {"device": device, "disable_radix_cache": False}
    prompts = load_prompts([{"id": f"p{i}", "text": f"{i}|prompt {i}"} for i in range(4)])
    return ProbeContext(client=eng, adapter=adapter, att=SimpleNamespace(restart={"kind": "embedded"}, spec={},
                                                                         target_dir=None),
                        run_dir=tmp_path, prompts=prompts, max_new_tokens=25, dl=Budget(900))


def _result(st, name):
    return {p["probe"]: p for p in st["probes"]}[name]


def test_invariant_check_probe_quotes_the_violation_of_its_copy(tmp_path):
    ad = LogCopies(_text("invariant_check.log"))
    st = run_probes(_ctx(tmp_path, ad), "all")
    r = _result(st, "invariant_check")
    assert r["status"] == "ran" and r["decision"] == "counts", r
    (f,) = r["findings"]
    assert f["kind"] == "engine_integrity_violation" and "KV page use-after-free" in f["detail"]
    assert f["evidence"]["violations"][0]["fired_in"].endswith("_check_kv_page_invariants")
    # the copy got the switch's environment, no flag; it was stopped; its log kept in the run folder
    assert ({}, SGLangAdapter().integrity_launch("invariant_check")["env"]) in ad.started and ad.stopped >= 1
    assert (tmp_path / r["evidence"]["log"]).is_file()
    assert r["evidence"]["prompts_with_hit"] == 4 and r["evidence"]["cold_accept_length"] == pytest.approx(3.0, abs=0.2)
    # on a CPU server the canary never starts: skipped, saying why
    c = _result(st, "kv_canary")
    assert c["status"] == "skipped" and "CPU server" in c["why"]


def test_kv_canary_copy_that_fails_to_start_is_failed_with_its_last_error_line(tmp_path):
    log = ("[2026-12-03 16:10:00 TP0] Scheduler hit an exception: Traceback (most recent call last):\n"
           "TypeError: Stream.__init__() got an unexpected keyword argument 'device'\n")
    ad = LogCopies(log, fail=True)
    r = _result(run_probes(_ctx(tmp_path, ad, device="cuda"), "all"), "kv_canary")
    assert r["status"] == "failed" and r["decision"] is None
    assert "exited with status 1" in r["why"] and "TypeError: Stream.__init__()" in r["why"]
    flags, env = next(s for s in ad.started if "--kv-canary" in s[0])
    assert flags["--kv-canary"] == "log" and env["SGLANG_KV_CANARY_STATS_PRINT_EVERY_N_STEPS"] == "1"


def test_restart_passes_the_switch_environment_on_top_of_the_launch(tmp_path, monkeypatch):
    seen = {}
    monkeypatch.setattr(restart_mod, "start_embedded", lambda *a, **kw: seen.update(kw) or "handle")
    launch = {"target": "t", "draft": "d", "tp": 1, "env": {"SGLANG_A": "1", "SGLANG_B": "launch"}}
    restart_mod.start_variant({"kind": "embedded", "launch": launch}, log_path=tmp_path / "l", budget=Budget(5),
                              env={"SGLANG_B": "probe"})
    assert seen["env"] == {"SGLANG_A": "1", "SGLANG_B": "probe"}
    restart_mod.start_variant({"kind": "embedded", "launch": {**launch, "env": {}}}, log_path=tmp_path / "l",
                              budget=Budget(5))
    assert seen["env"] is None
    # a relaunch command: this process's environment plus the switch's; none given, the process's own (None)
    monkeypatch.setattr(restart_mod.ServerProcess, "launch_healthy",
                        classmethod(lambda cls, argv, url, **kw: seen.update(kw, argv=argv) or "handle"))
    monkeypatch.setenv("E3F_PROBE_TEST_VAR", "kept")
    cmd = {"kind": "command", "argv": ["python", "-m", "sglang.launch_server", "--model-path", "m"]}
    restart_mod.start_variant(cmd, log_path=tmp_path / "l", budget=Budget(5), env={"SGLANG_INVARIANT_CHECK": "1"})
    assert seen["env"]["SGLANG_INVARIANT_CHECK"] == "1" and seen["env"]["E3F_PROBE_TEST_VAR"] == "kept"
    restart_mod.start_variant(cmd, log_path=tmp_path / "l", budget=Budget(5))
    assert seen["env"] is None and seen["argv"][:3] == ["python", "-m", "sglang.launch_server"]


def test_a_copy_that_answers_nothing_is_failed_unless_its_log_says_why(tmp_path):
    log = ("[2026-12-03 16:10:00 TP0] Scheduler hit an exception: Traceback (most recent call last):\n"
           "AssertionError: SimplePhaseChecker: phase mismatch (caller '': expect 0, actual 2)\n")
    r = _result(run_probes(_ctx(tmp_path, LogCopies(log, dead=True)), "all"), "invariant_check")
    assert r["status"] == "failed" and "answered none of its 8 requests" in r["why"]
    assert "connection refused" in r["why"] and "AssertionError: SimplePhaseChecker" in r["why"]
    stalled = ("[2026-12-03 16:10:00 TP0] RuntimeError: kv-canary: kernel_run_counter did not increase since previous "
               "check for tags=[TAIL_K_FULL] at step=64; canary path is not executing\n")
    r = _result(run_probes(_ctx(tmp_path, LogCopies(stalled, dead=True), device="cuda"), "all"), "kv_canary")
    assert r["status"] == "ran" and r["decision"] == "undecided" and "installed but not running" in r["why"]
