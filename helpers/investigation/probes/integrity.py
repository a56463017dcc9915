"""The engine's own integrity switches (``kv_canary``, ``invariant_check``; restart): a restarted copy of the server
with one of SGLang's integrity checks turned on (the engine adapter's ``integrity_launch``: flags and environment),
the live prompts sent cold (the prefix cache flushed before each) and once more with their prefix in the radix cache
(:func:`helpers.investigation.probes.cache.warm_arm`), the copy stopped, and its log scanned for the check's
violation lines. Each violation is quoted (the log's line number, the message, the TP rank and the SGLang function
that logs it) in an ``engine_integrity_violation`` finding; a check that fired nothing is ``clear`` only when the
log shows it ran (its own per-step line), else ``undecided``.

What SGLang 0.5.23 has (read in the installed package, ``env/reference/.venv``):

KV canary (``--kv-canary none|log|raise``, ``sglang/srt/arg_groups/fields/observability.py``; the config
``sglang/srt/kv_canary/config.py::CanaryConfig.from_env``):
  * ``sglang/srt/kv_canary/api.py::install_canary`` (called by ``model_runner.py::ModelRunner.
    _init_post_memory_pool_components``, before the decode graphs) attaches canary buffers to the KV pool and brackets
    every ``model.forward``: a pre-op writes each new slot's token id, position and a chain hash (the previous slot's
    hash), a post-op verifies the slots the forward read (per-forward HEAD/TAIL launches); ``--kv-canary-sweep-interval
    N`` also verifies every radix-held slot every N-th forward (``runner/sweep.py``, target runner only: the scheduler
    attaches the radix cache to the target). ``--kv-canary-real-data none|partial|all`` adds a hash of the real K/V
    bytes of the slot (``RealKvHashMode``; partial: the first 16 bytes), so a slot overwritten with other K/V is caught,
    not only one whose token bookkeeping is wrong. ``SGLANG_KV_CANARY_ENABLE_VERIFY_TOKEN_ASSERT`` compares the stored
    token ids with each request's ``origin_input_ids + output_ids``; ``SGLANG_KV_CANARY_ENABLE_WRITE_INPUT_ASSERT``
    compares written inputs with an oracle's (``token_oracle``, only with ``SGLANG_KV_CANARY_ENABLE_TOKEN_ORACLE``);
    ``SGLANG_KV_CANARY_RING_CAPACITY`` rows of violation detail are kept (``sglang/srt/environ.py``).
  * The EAGLE draft's KV pool gets its own canary: ``install_canary`` runs on the draft's model runner too, with
    ``kv_token_id_vs_position_offset = 1`` (EAGLE draft pools rotate the input ids, so slot ``p`` holds the K/V of
    the token at position ``p + 1``) and ``is_eagle_draft_decode``; the draft runner never sweeps (no radix cache
    attached) and is exempt from the sweep tags of the health check (``runner/health_checker.py::
    KernelRunCounterHealthChecker._expected_active_tags_for_health_check``).
  * ``log``: each violation is logged as a WARNING and the server keeps serving; ``raise``: the same messages raised
    as a ``RuntimeError`` at the next device-to-host pump (``runner/violation_reporter.py::ViolationReporter.
    log_or_raise_violation``). The first line of each is frozen: ``kv_canary violation: launch_tag=... fail_reason=...
    slot_idx=... position=... stored_token=... expected_token=...`` (``_format_violation``). Every
    ``SGLANG_KV_CANARY_STATS_PRINT_EVERY_N_STEPS`` forwards: ``[canary] step=... protected_tokens=... sweep_passes=...
    violations=...`` (``runner/stats_logger.py::PeriodicCanaryStatsLogger``): the proof it ran. A launch that stops
    running raises ``kv-canary: kernel_run_counter did not increase ... canary path is not executing``.
  * Its own self-test faults are environment switches (``SGLANG_KV_CANARY_PERTURB_*``: ``REQ_TO_TOKEN_PROB``,
    ``REAL_KV_USED_PROB``, ``REAL_KV_UNUSED_CACHE_PROB``, ``REAL_KV_POST_FORWARD_PROB``, ``NEXT_TOKEN_SWAP_PROB`` after
    ``PERTURB_WARMUP_STEPS``; ``sglang/srt/kv_canary/perturb/config.py::PerturbConfig.from_env``).
  * Off CUDA every canary kernel falls back to a torch reference (``sglang/kernels/ops/kv_canary/_dispatch.py::
    use_torch_reference``), but on a CPU build it cannot start: ``runner/canary_manager.py::CanaryManager.__init__``
    creates its copy stream with ``sglang/srt/utils/common.py::create_device_stream`` (``torch.cpu.Stream`` takes no
    ``device``), ``runner/future_tensor.py::FutureTensors.device_to_host`` pins host memory (needs CUDA), and two
    Triton-only kernels sit on its path (``sglang/srt/utils/phase_checker.py::SimplePhaseChecker.update`` every
    forward; ``sglang/kernels/ops/kv_canary/scatter_req_token_ids.py`` with the token assert). The probe is skipped on
    a CPU server (the adapter's ``integrity_refusal``), never left to fail at start. (With those four replaced by
    their torch equivalents, test-only shims of the stand-in's ``env/reference/standin/e3f_boot.py``, it runs on the
    embedded CPU server: the liveness bench below.)

Invariant checks:
  * ``SGLANG_INVARIANT_CHECK`` 0/1/2 (``InvariantCheckLevel`` OFF/WARN/STRICT, ``sglang/srt/environ.py``; unset, the
    legacy ``SGLANG_ENABLE_ASYNC_ASSERT`` counts as STRICT: ``sglang/srt/utils/invariants.py::resolve_level``) gates
    the signal of declared value/index invariants (``invariants.py::expect``): WARN logs ``invariant-check [name@rankR]:
    +N hit(s), T total. ...`` on the first hit and then every 512 checks (``_CheckReporter.record``); STRICT (and WARN
    for ``FATAL_UNCONTAINABLE`` ones) asserts ``invariant-check FAILED [name]: ...`` (``_signal``). In 0.5.23 the
    declared invariants are DSpark's (``models/dspark.py``, ``speculative/dspark_components/``), the SWA allocator's
    (``mem_cache/allocator/swa.py``) and the DeepSeek-V4.1 request window's (``mem_cache/dsv41_request_window.py``):
    none is on an EAGLE-3 path over a full-attention model, and a check that holds logs nothing.
  * The scheduler's own checker (``sglang/srt/managers/scheduler_components/invariant_checker.py``):
    ``SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY`` 1/2 checks after every batch that the KV pool adds up
    (available + evictable + protected + held + the running requests' own = total; a failure asserts ``Full Pool Mem
    Leak Detected!``), level 2 logging ``[Mem Check (BUSY)] [full] total=...`` each time (``self_check_during_busy``:
    the proof it ran); ``SGLANG_CHECK_KV_PAGE_INVARIANTS`` then checks that no request's slot is in the free pool
    (``KV page use-after-free: ...``) and that no page is free twice (``KV double free: ...``:
    ``_check_kv_page_invariants``). When idle, the scheduler checks the pools (``pool memory leak detected!``,
    ``req_to_token_pool memory leak detected!``: ``scheduler.py::Scheduler`` idle check, ``_report_leak`` /
    ``_check_req_pool``); ``SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE`` (default on) makes those and the page checks
    raise, off they warn (``sglang/srt/utils/common.py::raise_error_or_warn``). The copy runs WARN, busy level 2, the
    page checks on and the idle strictness off, so a hit is logged and the copy keeps answering.

Liveness: SGLang logs nothing when a check holds, so a silent log says nothing unless the check is seen running: the
canary's ``[canary] ... protected_tokens=N`` (N > 0) and the busy checker's ``[Mem Check (BUSY)]`` lines. That they
fire on a fault on this build is shown by ``bench/bench_integrity.py`` with the test-only faults of
``tests/support/integrity_faults.py`` (one server each: clean, nothing fired; armed, ``KV page use-after-free`` /
``kv_canary violation: ... fail_reason=verify_real_kv_hash`` quoted; bench/RESULTS.md); ``SGLANG_INVARIANT_CHECK``'s
own invariants have no such line and none is on this path, so they are reported as run, not as shown live.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ...diagnosis.detectors import finding
from ...errors import ServerError
from ...runfiles import write_json
from .base import Probe, ProbeContext, ProbeResult
from .cache import _al, on_copy, warm_arm

#: a line of SGLang's log: ``[2026-12-03 13:11:23 TP0] message`` (the TP rank of the scheduler that logged it)
_PREFIX = re.compile(r"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d(?: (?P<rank>[A-Z]+\d+(?:[ _-][A-Z]+\d+)*))?\] ?")
#: quoted violations kept per probe (the count says how many there were)
MAX_QUOTED = 20


@dataclass(frozen=True)
class Switch:
    """One integrity switch's log vocabulary (SGLang 0.5.23).

    Attributes:
        name: the probe's name. violations: ``(regex, SGLang file::function that logs it)`` per violation line.
        live: the regex of the switch's own per-step line (the proof it ran), with a group ``n`` whose integer must
            be > 0 for the line to count (None: any match counts); live_where: the function that logs it.
        stalled: lines that say the switch is installed but not running (``(regex, where)``).
        note: said with a clear decision (what a clear log does not cover).
    """

    name: str
    violations: tuple[tuple[re.Pattern, str], ...]
    live: re.Pattern
    live_where: str
    stalled: tuple[tuple[re.Pattern, str], ...] = ()
    note: str = ""


_INV = "sglang/srt/managers/scheduler_components/invariant_checker.py::SchedulerInvariantChecker."
SWITCHES = {
    "kv_canary": Switch(
        "kv_canary",
        violations=((re.compile(r"kv_canary violation: launch_tag=\S+ fail_reason=\S+"),
                     "sglang/srt/kv_canary/runner/violation_reporter.py::ViolationReporter.log_or_raise_violation"),
                    (re.compile(r"\[canary\] step=\d+ protected_tokens=\d+ sweep_passes=\d+ violations=[1-9]"),
                     "sglang/srt/kv_canary/runner/stats_logger.py::PeriodicCanaryStatsLogger._postprocess_on_host")),
        live=re.compile(r"\[canary\] step=\d+ protected_tokens=(?P<n>\d+)"),
        live_where="sglang/srt/kv_canary/runner/stats_logger.py::PeriodicCanaryStatsLogger._postprocess_on_host",
        stalled=((re.compile(r"kv-canary: kernel_run_counter did not increase"),
                  "sglang/srt/kv_canary/runner/health_checker.py::KernelRunCounterHealthChecker._postprocess_on_host"),)),
    "invariant_check": Switch(
        "invariant_check",
        violations=((re.compile(r"invariant-check \[[^\]]+\]: \+\d+ hit\(s\)"),
                     "sglang/srt/utils/invariants.py::_CheckReporter.record"),
                    (re.compile(r"invariant-check FAILED \[[^\]]+\]"), "sglang/srt/utils/invariants.py::_signal"),
                    (re.compile(r"(?:Full|SWA) Pool Mem Leak Detected!"), _INV + "self_check_during_busy"),
                    (re.compile(r"KV (?:double free|page use-after-free):"), _INV + "_check_kv_page_invariants"),
                    (re.compile(r"req_to_token_pool memory leak detected!"), _INV + "_check_req_pool"),
                    (re.compile(r"\b(?:pool|pool-bytes) memory leak detected!"),
                     _INV + "_report_leak (the idle check of sglang/srt/managers/scheduler.py)")),
        live=re.compile(r"\[Mem Check \(BUSY\)\] \[full\]"),
        live_where=_INV + "self_check_during_busy",
        note=("SGLANG_INVARIANT_CHECK's own value checks (sglang/srt/utils/invariants.py) are declared in SGLang "
              "0.5.23 only for DSpark drafting, SWA pools and the DeepSeek-V4.1 request window, and log only on a hit: "
              "the KV pool and page checks are what ran here")),
}


def _split(line: str) -> tuple[Optional[str], str]:
    m = _PREFIX.match(line)
    return (m.group("rank"), line[m.end():]) if m else (None, line)


def read_log(path: Path) -> str:
    """A server log's text as written ("" when there is none): no newline translation, so that a ``\r`` (a progress
    bar) stays inside its line and :func:`scan_log`'s line numbers are the file's (``sed -n Np``)."""
    try:
        with open(path, newline="", errors="replace") as f:
            return f.read()
    except FileNotFoundError:
        return ""


def scan_log(text: str, switch: str) -> dict:
    """The integrity lines of one server log (``text``) for ``switch`` (a key of :data:`SWITCHES`).

    Returns ``{"violations": [{"line": 1-based line number, "rank": "TP0" or None, "message": the line without its
    time prefix (at most 400 characters), "fired_in": SGLang file::function, "repeats": later lines with the same
    message}, ...] (first :data:`MAX_QUOTED` distinct), "violation_lines": every matching line, "live_lines": lines of
    the switch's own per-step line (counted only with ``n`` > 0), "live_first": the first such line (quoted, with its
    number) or None, "live_where", "stalled": quoted lines saying it is installed but not running}``."""
    sw = SWITCHES[switch]
    seen: dict[tuple[str, str], dict] = {}
    quoted: list[dict] = []
    stalled: list[dict] = []
    n_viol = n_live = 0
    live_first = None
    for no, raw in enumerate(text.split("\n"), 1):       # numbered as the file's lines (not splitlines: a \r)
        rank, msg = _split(raw.rstrip())
        for rx, where in sw.violations:
            m = rx.search(msg)
            if m:
                n_viol += 1
                body = msg[m.start():][:400]
                key = (where, body)
                if key in seen:
                    seen[key]["repeats"] += 1
                elif len(quoted) < MAX_QUOTED:
                    seen[key] = {"line": no, "rank": rank, "message": body, "fired_in": where, "repeats": 0}
                    quoted.append(seen[key])
                break
        m = sw.live.search(msg)
        if m and (sw.live.groupindex.get("n") is None or int(m.group("n")) > 0):
            n_live += 1
            if live_first is None:
                live_first = {"line": no, "rank": rank, "message": msg[m.start():][:300]}
        for rx, where in sw.stalled:
            if rx.search(msg) and len(stalled) < MAX_QUOTED:
                stalled.append({"line": no, "rank": rank, "message": msg[:400], "fired_in": where})
    return {"violations": quoted, "violation_lines": n_viol, "live_lines": n_live, "live_first": live_first,
            "live_where": sw.live_where, "stalled": stalled}


_ERROR = re.compile(r"\b(?:[A-Z]\w*(?:Error|Exception)|error|FAILED)\b")


def last_error_line(text: str) -> Optional[str]:
    """The last line of a server log that reads as an error (an ``...Error`` / ``...Exception`` name, ``error``,
    ``FAILED``; a ``Traceback`` header is skipped), without its time prefix, at most 300 characters; None when none
    does."""
    for raw in reversed(text.splitlines()):
        msg = _split(raw.strip())[1].strip()
        if msg and not msg.startswith("Traceback") and _ERROR.search(msg):
            return msg[:300]
    return None


def decide(scan: dict, switch: str, *, error: Optional[str] = None) -> tuple[Optional[str], str, Optional[str]]:
    """``(decision, status, why)`` of one switch's scanned log (:func:`scan_log`) and the copy's error, if any (its
    start or its requests failed: one line).

    ``counts`` when a violation line fired (whatever else happened: a violation that stopped the copy is still one);
    else ``undecided`` when the log says the switch is installed but not running; else ``failed`` (decision None)
    when the copy failed; ``undecided`` when the log shows no line of the switch running ("ran, fired nothing, liveness not shown on this build"); ``clear``
    when its own per-step line shows it ran and nothing fired."""
    sw = SWITCHES[switch]
    if scan["violations"]:
        first = scan["violations"][0]
        return "counts", "ran", (f"{scan['violation_lines']} violation line(s); first at log line {first['line']}: "
                                 f"{first['message'][:200]} ({first['fired_in']})")
    if scan["stalled"]:
        s = scan["stalled"][0]
        return "undecided", "ran", f"installed but not running: log line {s['line']}: {s['message'][:200]}"
    if error is not None:
        return None, "failed", error
    if not scan["live_lines"]:
        return "undecided", "ran", (f"ran, fired nothing, liveness not shown on this build: no line of "
                                    f"{sw.live_where} in the copy's log")
    lf = scan["live_first"]
    why = (f"ran live ({scan['live_lines']} per-step line(s) of {sw.live_where}, the first at log line {lf['line']}) "
           "and fired nothing")
    return "clear", "ran", why + (f"; {sw.note}" if sw.note else "")


def _applies(switch: str):
    def applies(ctx: ProbeContext) -> Optional[str]:
        if ctx.adapter.integrity_launch(switch) is None:
            return f"{ctx.adapter.label} has no {switch} switch this tool has read"
        return ctx.adapter.integrity_refusal(switch, ctx.client.server_info())
    return applies


def _run(switch: str):
    def run(ctx: ProbeContext) -> ProbeResult:
        p = BY_NAME[switch]
        launch = ctx.adapter.integrity_launch(switch)
        folder = ctx.folder(switch)
        rel = str(folder.relative_to(ctx.run_dir))
        arms: dict = {}

        def warm(sub: ProbeContext) -> None:
            arms["warm"] = warm_arm(sub)

        error = None
        try:
            arms["cold"] = on_copy(ctx, folder, flags=launch["flags"] or None, env=launch["env"] or None, then=warm,
                                   what=f"the {switch} copy (--engine-probes all)")
        except ServerError as exc:
            error = str(exc).splitlines()[0][:300]
        text = read_log(Path(folder) / "server.log")
        if error is not None:
            error = f"{error} (the copy's log: {last_error_line(text) or 'no error line'})"
        scan = scan_log(text, switch)
        ev: dict = {"flags": launch["flags"], "env": launch["env"], "log": str(Path(rel) / "server.log"),
                    "saved_to": rel, **scan}
        for name, frame in arms.items():
            frame.to_parquet(Path(folder) / f"{name}.parquet")
            ev[f"{name}_accept_length"] = _al(frame)
            ev[f"{name}_failed"] = int(frame["error"].notna().sum())
        if error is None and arms and all(f["error"].notna().all() for f in arms.values()):
            first = next(iter(arms.values()))["error"].dropna()
            error = (f"the copy answered none of its {sum(len(f) for f in arms.values())} requests"
                     + (f" (first error: {first.iloc[0]})" if len(first) else "")
                     + f" (the copy's log: {last_error_line(text) or 'no error line'})")
        if "warm" in arms and "cached_tokens" in arms["warm"]:
            ev["prompts_with_hit"] = int((arms["warm"]["cached_tokens"].fillna(0) > 0).sum())
        write_json(Path(folder) / "scan.json", ev)
        decision, status, why = decide(scan, switch, error=error)
        res = ProbeResult(p.name, p.cost, p.condition, status=status, decision=decision, evidence=ev, why=why,
                          saved_to=[rel])
        if decision == "counts":
            quoted = "; ".join(f"log line {v['line']}{' ' + v['rank'] if v['rank'] else ''}: {v['message'][:160]} "
                               f"({v['fired_in']})" for v in scan["violations"][:3])
            res.findings.append(finding(
                "engine_integrity_violation", None,
                f"{ctx.adapter.label}'s {switch} fired {scan['violation_lines']} time(s) on a restarted copy serving "
                f"the live prompts (cold, then with their prefix cached): {quoted}",
                switch=switch, violations=scan["violations"], violation_lines=scan["violation_lines"],
                log=ev["log"], flags=launch["flags"], env=launch["env"],
                source=f"engine-state probe {switch}: the copy's own log (helpers.investigation.probes.integrity)"))
        return res
    return run


#: why the integrity switches apply to an MTP / NextN head's server as they are (SGLang 0.5.23)
INTEGRITY_MTP = ("the checks are installed on every model runner, the head's draft runner too "
                 "(sglang/srt/model_executor/model_runner.py::ModelRunner._init_post_memory_pool_components -> "
                 "kv_canary/api.py::install_canary), and NEXTN runs as EAGLE (ids rotated by one in the draft pool)")


def _estimate(ctx: ProbeContext) -> float:
    return 90.0 + 0.1 * len(ctx.prompts) * ctx.max_new_tokens


KV_CANARY = Probe("kv_canary", "restart", "with the engine's KV canary on",
                  "does the engine's KV canary find a KV slot holding other than its token's KV?", _run("kv_canary"),
                  applies=_applies("kv_canary"), estimate_s=_estimate, part="cache state",
                  mtp_why=INTEGRITY_MTP)
INVARIANT_CHECK = Probe("invariant_check", "restart", "with the engine's invariant checks on",
                        "do the engine's invariant checks (KV pool accounting, KV pages, value invariants) fire?",
                        _run("invariant_check"), applies=_applies("invariant_check"), estimate_s=_estimate,
                        part="cache state", mtp_why=INTEGRITY_MTP)
BY_NAME = {p.name: p for p in (KV_CANARY, INVARIANT_CHECK)}

__all__ = ["INVARIANT_CHECK", "KV_CANARY", "SWITCHES", "decide", "last_error_line", "read_log", "scan_log"]
