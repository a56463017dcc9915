"""Acceptance over time (``python -m helpers watch``): one sample per interval of a running server's own counters and
of a light probe, appended to a run folder that survives a crash, and the decay detector run on each new sample.

**What a sample is** (one ``kind: "sample"`` line of ``watch.jsonl``):

* the engine's snapshot of ``/metrics`` (``EngineAdapter.watch_snapshot``: cumulative counters and gauges), kept as
  ``counters`` so the next sample (or a resumed run) can subtract it;
* ``accept_length``: over the interval, from the **delta of cumulative counters** (delta generation tokens / delta
  verify steps, ``accept_length_source: "counters"``), which counts every request that finished in the interval,
  the probe's included; when no verify step finished in the interval, the probe's own (``"probe"``); else the
  engine's gauge (``"gauge"``: SGLang's ``spec_accept_length`` of its last logging window, a window this tool does
  not know); ``None`` otherwise. The series the detector reads;
* ``probe``: one short greedy request on fixed prompts (the bundled set, in turn): its tokens, verify steps, accept
  length and rate from its ``meta_info``, its wall seconds;
* covariates: ``uptime_s`` (from the server's own start time when it reports one, ``uptime_source``, else since the
  run's first sample or the last server restart seen), ``kv_cache_use`` (0-1), ``cache_hit_rate`` (delta cached /
  delta prompt tokens over the interval, ``cache_hit_rate_source: "counters"``, else the engine's gauge), and
  ``running_reqs``;
* ``load``: the watch's own load on the server: ``probe_token_share`` = the probe's tokens / the server's generated
  tokens over the interval, ``probe_time_share`` = the probe's request seconds / the interval's seconds;
* ``change``: the detector's change point over the window (:mod:`helpers.acceptance.decay`), with the covariates'
  steps, and ``decision``;
* ``lifecycle`` / ``events``: what a client sees that may change the served draft (:mod:`helpers.acceptance.lifecycle`:
  the server's start, weight version, model path, the weight-load gauge, the draft checksum, the fixed probe's
  answer) and the names of the events since the previous sample.

Other lines: ``start`` (each start or resume: URL without credentials, engine, settings), ``error`` (a sample that
failed, with the reason; the watch goes on), ``drop`` (a triggered drop: the decision with its CI), ``investigation``
(what the drop handler returned), ``event`` (lifecycle events of a sample, :mod:`helpers.acceptance.lifecycle`, with
the action taken), ``check_draft`` (what the event handler returned: the check's run folder and verdict;
``interrupted`` when a signal stopped it), ``warning`` (once: ``/metrics`` has none of the token / verify counters,
the accept length is the probe's), ``stop`` (why the watch ended). One watch writes a run folder at a time
(:class:`WatchLog`'s lock); a resumed log is checked line by line (:func:`check_record`).

**Durability.** Each line is one ``os.write`` of the whole line to a file opened ``O_APPEND``, then ``fsync``: a
crash or a signal leaves at most the line being written torn, which :func:`read_log` skips (counted, never fatal);
a resumed run first ends a torn last line with a newline, so nothing is ever rewritten. **Memory** is bounded over
days: the detector's window (``window`` samples), the run's first ``baseline_n`` accept lengths and the last
sample's counters; nothing else is kept.
"""
from __future__ import annotations

import errno
import fcntl
import json
import math
import os
import stat
import time
from collections import deque
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

from ..errors import BadInput, SGLangError
from ..paths import shared_mode
from ..redaction import scrub
from ..runfiles import jsonable, loads_json
from .decay import ALPHA, MIN_SEGMENT, DropDecision, change_point, covariate_steps, decide_drop
from .lifecycle import Lifecycle

LOG_NAME = "watch.jsonl"
#: the covariates the detector relates to a change, in the order reported
COVARIATES = ("uptime_s", "kv_cache_use", "cache_hit_rate", "running_reqs")
FORMAT = {"format": "e3f-watch", "version": 1}
#: the lock file of a run folder (:class:`WatchLog`): one watch writes a run folder at a time
LOCK_NAME = "watch.lock"
#: the longest line :func:`iter_log` reads (a sample line is a few KiB): a longer one -- a torn or foreign giant line
#: -- is skipped in chunks, so reading a log takes bounded memory whatever it holds
MAX_LINE_BYTES = 1 << 20
#: bounds of a resumed log's fields (:func:`check_record`): sample / event / drop numbers, and how far in the future a
#: recorded time may be (clock skew between the machine that wrote the log and this one)
MAX_INDEX = 10 ** 9
FUTURE_SKEW_S = 300.0
#: the tokens a light probe may ask for (``--probe-tokens``): a probe is a short request
MAX_PROBE_TOKENS = 4096
#: gauges of a snapshot that are shares (0-1) and gauges / counters that cannot be negative (:func:`check_snapshot`)
SHARE_GAUGES = ("kv_cache_use", "cache_hit_rate_gauge", "accept_rate_gauge")
NON_NEGATIVE = ("running_reqs", "queue_reqs", "generation_tokens", "verify_steps", "requests", "prompt_tokens",
                "cached_tokens", "draft_tokens", "accepted_tokens", "weight_load_s")


@dataclass
class LogRead:
    """What :func:`read_log` found: the records (dicts, in order) and the lines it skipped (torn or not JSON)."""

    records: list
    skipped: int = 0


def _regular_log(path: Path) -> None:
    """``path`` is a regular file, not a symlink (a log that points elsewhere would be appended into another file).

    Raises:
        BadInput: missing, a symlink, or not a regular file."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        raise BadInput(f"no {LOG_NAME} here: expected a watch run folder (python -m helpers watch)",
                       path=path) from None
    except OSError as exc:
        raise BadInput(f"cannot be read: {exc.strerror or exc}", path=path) from None
    if stat.S_ISLNK(mode):
        raise BadInput(f"{LOG_NAME} is a symlink: a watch run folder's log is a regular file (refused, so nothing is "
                       "appended into the file it points to)", path=path)
    if not stat.S_ISREG(mode):
        raise BadInput(f"{LOG_NAME} is not a regular file", path=path)


def _lines(fh: Any) -> Iterator[tuple[int, Optional[bytes]]]:
    """``(line number, bytes)`` of each line of ``fh``; a line longer than :data:`MAX_LINE_BYTES` comes as None (its
    rest skipped in chunks: bounded memory)."""
    i = 0
    while True:
        raw = fh.readline(MAX_LINE_BYTES + 1)
        if not raw:
            return
        i += 1
        if len(raw) > MAX_LINE_BYTES and not raw.endswith(b"\n"):
            while raw and not raw.endswith(b"\n"):
                raw = fh.readline(MAX_LINE_BYTES)
            yield i, None
            continue
        yield i, raw


def iter_log(path: str | os.PathLike, skipped: Optional[list] = None,
             numbered: bool = False) -> Iterator[Any]:
    """The records of a ``watch.jsonl``, one at a time (bounded memory: a line longer than :data:`MAX_LINE_BYTES`
    is skipped in chunks). A line that is not a JSON object -- the torn last line after a crash, an empty line -- is
    skipped; its 1-based number is appended to ``skipped`` when given. ``numbered``: ``(line number, record)`` pairs.

    Raises:
        BadInput: the file does not exist, is a symlink or not a regular file, or cannot be read."""
    p = Path(path)
    _regular_log(p)
    with open(p, "rb") as fh:
        for i, raw in _lines(fh):
            rec = None
            if raw is not None:
                try:
                    rec = loads_json(raw.decode("utf-8"))
                except (ValueError, UnicodeDecodeError, RecursionError):
                    rec = None
            if isinstance(rec, dict) and "kind" in rec:
                yield (i, rec) if numbered else rec
            elif (raw is None or raw.strip()) and skipped is not None:
                skipped.append(i)


def _bad(path: Any, line: int, field_: str, expected: str, got: Any) -> BadInput:
    shown = repr(got)
    return BadInput(f"line {line}: field {field_!r} {'is ' + shown[:60] if got is not None else 'missing'}; expected "
                    f"{expected} (not a watch log, or a damaged one)", path=path, field=field_)


def check_record(rec: dict, *, path: Any, line: int, now: float) -> dict:
    """A resumed log's record checked before any of it is used (:meth:`Watcher.resume`): ``i`` / ``n`` a
    non-negative int below :data:`MAX_INDEX`, ``t`` finite, non-negative and at most :data:`FUTURE_SKEW_S` seconds
    after ``now`` (Unix seconds), ``reset_from`` such an index or None, ``url`` a string, ``counters`` /
    ``lifecycle`` objects (dicts) or None, ``accept_length`` and the covariates numbers or None. Returns ``rec``.

    Raises:
        BadInput: naming the file, the line and the field."""
    kind = rec.get("kind")

    def index(name: str, optional: bool = False) -> None:
        v = rec.get(name)
        if v is None and optional:
            return
        if not (isinstance(v, int) and not isinstance(v, bool) and 0 <= v < MAX_INDEX):
            raise _bad(path, line, name, f"an integer in [0, {MAX_INDEX})", v)

    def when(name: str = "t") -> None:
        v = rec.get(name)
        if not (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0):
            raise _bad(path, line, name, "a time in Unix seconds", v)
        if v > now + FUTURE_SKEW_S:
            raise _bad(path, line, name, f"a time not after now ({now:.0f}) + {FUTURE_SKEW_S:.0f} s", v)

    def number(name: str) -> None:
        v = rec.get(name)
        if v is not None and not (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)):
            raise _bad(path, line, name, "a finite number or null", v)

    if kind == "start":
        if not isinstance(rec.get("url"), str) or not rec["url"]:
            raise _bad(path, line, "url", "the server's URL (a string)", rec.get("url"))
        when()
    elif kind == "sample":
        index("i")
        when()
        for name in ("counters", "lifecycle"):
            if rec.get(name) is not None and not isinstance(rec[name], dict):
                raise _bad(path, line, name, "an object or null", rec[name])
        carried = (rec.get("lifecycle") or {}).get("carried")
        if carried is not None and not (isinstance(carried, list) and all(isinstance(c, str) for c in carried)):
            raise _bad(path, line, "lifecycle.carried", "a list of field names or null", carried)
        for name, v in (rec.get("counters") or {}).items():
            if name in NON_NEGATIVE and v is not None and not (
                    isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0):
                raise _bad(path, line, f"counters.{name}", "a count >= 0 or null", v)
        for name in ("accept_length", *COVARIATES):
            number(name)
    elif kind == "event":
        index("n")
        when()
    elif kind == "drop":
        index("n")
        when()
        index("reset_from", optional=True)
    return rec


def read_log(path: str | os.PathLike) -> LogRead:
    """Every record of a ``watch.jsonl`` (:func:`iter_log`), for the notebook page and the tests."""
    skipped: list = []
    recs = list(iter_log(path, skipped))
    return LogRead(recs, len(skipped))


class WatchLog:
    """The append-only ``watch.jsonl`` of a run folder (module docstring: one write + fsync per line), held under an
    exclusive lock (``fcntl.flock`` on ``<run>/watch.lock``, which holds the writer's PID) until :meth:`close`: a
    second watch on the same folder is refused.

    Raises:
        BadInput: another process holds the lock (naming its PID), or ``watch.jsonl`` is a symlink or not a regular
            file."""

    def __init__(self, run_dir: str | os.PathLike):
        self.path = Path(run_dir) / LOG_NAME
        self._fd = -1
        self._lock_fd = _lock(Path(run_dir))
        try:
            if os.path.lexists(self.path):
                _regular_log(self.path)
            try:
                self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, shared_mode())
            except OSError as exc:
                if exc.errno == errno.ELOOP:
                    _regular_log(self.path)                  # a symlink swapped in: the one-line refusal
                raise
            if os.fstat(self._fd).st_size:               # a resumed log: end a torn last line so it stays one line
                with open(self.path, "rb") as fh:
                    fh.seek(-1, os.SEEK_END)
                    if fh.read(1) != b"\n":
                        os.write(self._fd, b"\n")
        except BaseException:
            self.close()
            raise

    def append(self, record: dict) -> None:
        """Write ``record`` as one JSON line (secrets scrubbed), then fsync."""
        line = scrub(json.dumps(jsonable(record), default=str, allow_nan=False)) + "\n"
        os.write(self._fd, line.encode("utf-8"))
        os.fsync(self._fd)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if self._lock_fd >= 0:
            os.close(self._lock_fd)                      # releases the flock
            self._lock_fd = -1


def _lock(run_dir: Path) -> int:
    """An exclusive, non-blocking ``flock`` on ``run_dir/watch.lock`` (written with this PID); returns its fd.

    Raises:
        BadInput: another process holds it (its PID from the file), or the lock file is a symlink."""
    path = run_dir / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, shared_mode())
    except OSError as exc:
        raise BadInput(f"cannot open the run folder's lock file: {exc.strerror or exc}", path=path) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        try:
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "unknown"
        finally:
            os.close(fd)
        raise BadInput(f"another watch (PID {holder[:20]}) is writing this run folder; stop it first (one watch per "
                       "run folder)", path=run_dir) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def _now_iso(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).isoformat(timespec="seconds")


def _finite(x: Any) -> Optional[float]:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def _delta(now: dict, before: Optional[dict], name: str) -> Optional[float]:
    a, b = _finite(now.get(name)), _finite((before or {}).get(name))
    return None if a is None or b is None else a - b


def probe_once(client: Any, prompt: Any, *, max_new_tokens: int, timeout: float) -> dict:
    """One short greedy request (``client.generate``, the client contract of every engine) of ``prompt`` (a
    :class:`helpers.acceptance.prompts.Prompt`), read from its ``meta_info``: ``prompt_id``, ``completion_tokens``,
    ``verify_ct``, ``accept_length`` (= completion tokens / verify steps, None without a verify step),
    ``accept_rate`` (correct / proposed drafts), ``cached_tokens``, ``latency_s`` (client wall seconds).

    The engine's client checks the answer's spec counters against the server's settings once its ``/server_info``
    was read (``MetaInfo.spec_problem``: at most ``num_steps`` accepted draft tokens and a bonus per verify step;
    ``watch`` reads it before the first probe); the completion tokens are checked here against those asked.

    Raises what ``generate`` raises (:class:`helpers.errors.SGLangError` and its kinds) past ``timeout`` seconds;
    :class:`helpers.errors.SGLangError` for more completion tokens than ``max_new_tokens``."""
    r = client.generate(**prompt.request(), max_new_tokens=int(max_new_tokens), timeout=float(timeout))
    m = r.meta_info
    ct, v = m.completion_tokens, m.spec_verify_ct
    if ct is not None and ct > int(max_new_tokens):
        raise SGLangError(f"probe answer refused: meta_info.completion_tokens {ct} > the {int(max_new_tokens)} "
                          "max_new_tokens asked (impossible counters)", endpoint="/generate")
    acc = getattr(m, "spec_num_correct_drafts", None)
    prop = getattr(m, "spec_num_proposed_drafts", None)
    return {"prompt_id": prompt.id, "completion_tokens": ct, "verify_ct": v,
            "accept_length": (ct / v) if ct is not None and v else None,
            "accept_rate": (acc / prop) if acc is not None and prop else None,
            "cached_tokens": m.cached_tokens, "latency_s": r.latency_s}


def check_snapshot(snap: dict, endpoint: str = "/metrics") -> dict:
    """A ``watch`` snapshot (:meth:`helpers.engines.base.EngineAdapter.watch_snapshot`) checked before it is used:
    the shares (:data:`SHARE_GAUGES`: KV-cache use, hit rate, accept rate) in [0, 1], the requests and counters
    (:data:`NON_NEGATIVE`) >= 0. Returns ``snap``.

    Raises:
        SGLangError: naming the endpoint, the metric (the snapshot's ``sources``) and the value."""
    src = snap.get("sources") or {}
    for name in SHARE_GAUGES + NON_NEGATIVE:
        v = _finite(snap.get(name))
        if v is None:
            continue
        if (name in SHARE_GAUGES and not 0.0 <= v <= 1.0) or (name in NON_NEGATIVE and v < 0):
            want = "a share in [0, 1]" if name in SHARE_GAUGES else "a value >= 0"
            raise SGLangError(f"GET {endpoint}: {src.get(name, name).split(' (')[0]} is {v:g}, expected {want} "
                              f"(watch field {name}); sample refused", endpoint=endpoint)
    return snap


def read_snapshot(adapter: Any, text: str, endpoint: str = "/metrics") -> dict:
    """``adapter.watch_snapshot(text)`` then :func:`check_snapshot`; a text that is not Prometheus' text format (an
    HTML page, JSON) is one line naming the endpoint.

    Raises:
        SGLangError: not the Prometheus text format, or a value out of range."""
    try:
        snap = adapter.watch_snapshot(text)
    except (ValueError, TypeError, IndexError, KeyError) as exc:
        head = " ".join(str(text)[:60].split())
        raise SGLangError(f"GET {endpoint}: not the Prometheus text format ({type(exc).__name__}; the answer starts "
                          f"{head!r})", endpoint=endpoint) from None
    return check_snapshot(snap, endpoint)


#: the counters a sample's accept length comes from; a ``/metrics`` with none of them leaves only the probe
RATE_COUNTERS = ("generation_tokens", "verify_steps")


@dataclass
class WatchSettings:
    """The detector's and the trigger's settings (the CLI's flags): ``window`` samples the detector sees,
    ``baseline_n`` first samples whose mean is the run's baseline, ``min_segment``, ``alpha``, ``drop_below``
    (absolute accept length), ``drop_frac`` (share of the baseline lost), ``cooldown_s`` between two triggers,
    ``material`` (the smallest drop that matters from a reference accept length: the CLI passes
    ``helpers.draft.decide.threshold``)."""

    window: int = 240
    baseline_n: int = 10
    min_segment: int = MIN_SEGMENT
    alpha: float = ALPHA
    drop_below: Optional[float] = None
    drop_frac: Optional[float] = None
    cooldown_s: float = 1800.0
    material: Callable[[Optional[float]], float] = field(default=lambda ref: max(0.1, 0.08 * (ref or 0.0)))


class Watcher:
    """The sampling state of one watch run (module docstring): ``snapshot()`` returns the engine's ``/metrics``
    snapshot, ``probe()`` the probe's dict (or None without a probe), ``on_drop(n, decision)`` is called once per
    triggered drop (n = 1, 2, ...) and returns what to record (or None: only the drop is recorded). ``lifecycle``:
    the lifecycle observations (:class:`helpers.acceptance.lifecycle.Lifecycle`, None: none); ``on_event(n,
    events, sample)`` is called once per sample with events (n = 1, 2, ...) and returns what to record (the
    ``check_draft`` line; None: only the event is recorded). ``clock``: Unix seconds (tests pass a fake)."""

    def __init__(self, log: WatchLog, *, snapshot: Callable[[], dict], probe: Optional[Callable[[], dict]] = None,
                 settings: Optional[WatchSettings] = None,
                 on_drop: Optional[Callable[[int, DropDecision], Optional[dict]]] = None,
                 clock: Callable[[], float] = time.time, lifecycle: Optional[Lifecycle] = None,
                 on_event: Optional[Callable[[int, list, dict], Optional[dict]]] = None):
        self.log, self.snapshot, self.probe, self.on_drop, self.clock = log, snapshot, probe, on_drop, clock
        self.lifecycle, self.on_event = lifecycle, on_event
        self.n_events = 0
        self.last_check_t: Optional[float] = None
        self.s = settings or WatchSettings()
        self.window: deque = deque(maxlen=int(self.s.window))
        self.baseline_values: list[float] = []
        self.n_samples = 0
        self.n_drops = 0
        self.last_trigger_t: Optional[float] = None
        self.first_t: Optional[float] = None
        self.uptime_origin: Optional[float] = None
        self.prev: Optional[dict] = None
        self.prev_t: Optional[float] = None
        self.skipped_on_resume = 0
        self.warned_no_counters = False

    # -- state ----------------------------------------------------------------------------------------------------

    @property
    def baseline(self) -> Optional[float]:
        """The mean accept length of the run's first ``baseline_n`` samples (None until there are that many)."""
        v = self.baseline_values
        return sum(v) / len(v) if len(v) >= self.s.baseline_n else None

    def _remember(self, rec: dict) -> None:
        """Fold one sample record into the bounded state (also used on resume)."""
        self.n_samples = max(self.n_samples, int(rec.get("i", 0)) + 1)
        t = _finite(rec.get("t"))
        if self.first_t is None:
            self.first_t = t
        if rec.get("server_restarted") or self.uptime_origin is None:
            self.uptime_origin = t
        if rec.get("counters") is not None:
            self.prev, self.prev_t = rec["counters"], t
        if self.lifecycle is not None and rec.get("lifecycle") is not None:
            self.lifecycle.last = rec["lifecycle"]
        al = _finite(rec.get("accept_length"))
        if al is not None and len(self.baseline_values) < self.s.baseline_n:
            self.baseline_values.append(al)
        self.window.append({"i": rec.get("i"), "t": t, "accept_length": al,
                            **{c: _finite(rec.get(c)) for c in COVARIATES}})

    def _reset_window(self, from_i: int) -> None:
        """After a trigger: keep only the samples from the change on (the new level), so one drop triggers once."""
        kept = [w for w in self.window if w["i"] is not None and w["i"] >= from_i]
        self.window.clear()
        self.window.extend(kept)

    def resume(self, path: str | os.PathLike) -> int:
        """Rebuild the state from an existing log (streamed: bounded memory); returns the samples read.

        Raises:
            BadInput: a record the state would use is not what a watch writes (:func:`check_record`: file, line,
                field), or the log is a symlink."""
        skipped: list = []
        now = self.clock()
        for line, rec in iter_log(path, skipped, numbered=True):
            check_record(rec, path=path, line=line, now=now)
            k = rec.get("kind")
            if k == "sample":
                self._remember(rec)
            elif k == "event":
                self.n_events = max(self.n_events, int(rec.get("n", 0)))
                if rec.get("action") == "check-draft":
                    self.last_check_t = _finite(rec.get("t"))
            elif k == "drop":
                self.n_drops = max(self.n_drops, int(rec.get("n", 0)))
                self.last_trigger_t = _finite(rec.get("t"))
                if rec.get("reset_from") is not None:
                    self._reset_window(int(rec["reset_from"]))
        self.skipped_on_resume = len(skipped)
        return self.n_samples

    # -- one sample -----------------------------------------------------------------------------------------------

    def step(self) -> dict:
        """Take one sample (probe first, then ``/metrics``, so the interval's counters hold the probe), run the
        detector, record everything; returns the sample record. A failure of the probe is recorded in the sample
        (``probe_error``) and the counters still read; a failure of ``/metrics`` raises (the caller records it)."""
        t0 = self.clock()
        probe, probe_error = None, None
        if self.probe is not None:
            try:
                probe = self.probe()
            except Exception as exc:          # noqa: BLE001 - a failed probe is data; signals are BaseException
                probe_error = f"{type(exc).__name__}: {exc}"[:300]
        seen = self.lifecycle.observe() if self.lifecycle is not None else None
        snap = self.snapshot()
        t = self.clock()
        rec = self._sample(snap, probe, probe_error, t, t0, extra=seen)
        evs: list = []
        if seen is not None:
            rec["lifecycle"], evs = self.lifecycle.finish(seen, snap)
        if rec.get("server_restarted") and not any(e["event"] == "server_restarted" for e in evs):
            evs.insert(0, {"event": "server_restarted", "field": "counters", "before": None, "after": None})
        rec["events"] = [e["event"] for e in evs] or None
        if not self.warned_no_counters and all(_finite(snap.get(k)) is None for k in RATE_COUNTERS):
            self.warned_no_counters = True
            rec["warning"] = (f"/metrics has none of the counters {', '.join(RATE_COUNTERS)} (engine "
                              f"{snap.get('engine')}): the accept length comes from the probe only")
            self.log.append({"kind": "warning", "t": t, "time": rec["time"], "i": rec["i"], "warning": rec["warning"]})
        self._remember(rec)
        decision = self._detect(rec)
        self.log.append(rec)
        if evs:
            self._event(evs, rec)
        if decision is not None and decision.trigger:
            self._trigger(decision, rec)
        return rec

    def _event(self, evs: list, rec: dict) -> None:
        """Record the sample's lifecycle events (an ``event`` line) and run the event handler once (its result is
        the ``check_draft`` line, also kept in ``rec["check"]`` for the terminal line). A sample whose only event is
        the fixed probe's answer runs no check within ``cooldown_s`` of the last check (a server whose greedy answers
        keep moving under load would check every interval); the other events always do."""
        self.n_events += 1
        action = "check-draft" if self.on_event else "record"
        answer_only = all(e["event"] == "probe_answer_changed" for e in evs)
        if (self.on_event and answer_only and self.last_check_t is not None
                and rec["t"] - self.last_check_t < self.s.cooldown_s):
            action = (f"record (cooldown: {rec['t'] - self.last_check_t:.0f} s of {self.s.cooldown_s:.0f} s since the "
                      "last check, and only the fixed probe's answer changed)")
        self.log.append({"kind": "event", "n": self.n_events, "t": rec["t"], "time": rec["time"], "i": rec["i"],
                         "events": evs, "action": action})
        if action != "check-draft":
            return
        self.last_check_t = rec["t"]
        t0 = self.clock()
        try:
            out = dict(self.on_event(self.n_events, evs, rec) or {})
        except Exception as exc:             # noqa: BLE001 - recorded; the watch goes on (signals propagate)
            out = {"error": f"{type(exc).__name__}: {exc}"[:500]}
        except BaseException as exc:         # a signal: the check's line says so, then the signal goes on
            self.log.append({"kind": "check_draft", "n": self.n_events, "t": self.clock(),
                             "seconds": self.clock() - t0, "verdict": "interrupted",
                             "reason": (str(exc) or type(exc).__name__)[:300]})
            raise
        self.log.append({"kind": "check_draft", "n": self.n_events, "t": self.clock(), "seconds": self.clock() - t0,
                         **out})
        rec["check"] = out.get("verdict") or ("error" if out.get("error") else None)
        # the check took the server's time: the next interval starts now
        self.prev = None
        self.prev_t = None

    def _sample(self, snap: dict, probe: Optional[dict], probe_error: Optional[str], t: float, t0: float,
                extra: Optional[dict] = None) -> dict:
        prev = self.prev
        restarted = False
        d = {k: _delta(snap, prev, k) for k in ("generation_tokens", "verify_steps", "prompt_tokens",
                                                "cached_tokens", "requests")}
        if any(v is not None and v < 0 for v in d.values()):
            restarted, d = True, {k: None for k in d}          # counters went down: the server restarted
        interval = (t - self.prev_t) if self.prev_t is not None and not restarted else None
        al, src = None, None
        if d["verify_steps"] and d["generation_tokens"] is not None:
            al, src = d["generation_tokens"] / d["verify_steps"], "counters"
        elif probe and probe.get("accept_length") is not None:
            al, src = probe["accept_length"], "probe"
        elif _finite(snap.get("accept_length_gauge")) is not None:
            al, src = float(snap["accept_length_gauge"]), "gauge"
        hit, hit_src = None, None
        if d["prompt_tokens"] and d["cached_tokens"] is not None:
            hit, hit_src = d["cached_tokens"] / d["prompt_tokens"], "counters"
        elif _finite(snap.get("cache_hit_rate_gauge")) is not None:
            hit, hit_src = float(snap["cache_hit_rate_gauge"]), "gauge"
        start = _finite(snap.get("start_time"))
        if start is not None:
            uptime, up_src = t - start, "server start time (process_start_time_seconds)"
        else:
            origin = t if restarted or self.uptime_origin is None else self.uptime_origin
            uptime, up_src = t - origin, "since the first sample" + (" after a server restart" if restarted or (
                self.uptime_origin is not None and self.uptime_origin != self.first_t) else "")
        # the watch's own requests: the light probe's and the lifecycle's fixed probe (its tokens, its seconds)
        pt = (probe or {}).get("completion_tokens")
        ps = (probe or {}).get("latency_s")
        if extra is not None:
            pt = (pt or 0) + int(extra.get("tokens") or 0)
            ps = (ps or 0.0) + float(extra.get("seconds") or 0.0)
        lag = pt is not None and d["generation_tokens"] is not None and pt > d["generation_tokens"]
        load = {"probe_tokens": pt, "server_tokens": d["generation_tokens"],
                "probe_token_share": (pt / d["generation_tokens"]) if pt is not None and d["generation_tokens"]
                and not lag else None,
                "counters_lag": (f"the watch's own {pt} tokens exceed the server's {d['generation_tokens']:g} "
                                 "generation tokens over the interval: the counters do not hold all of the probe's "
                                 "requests yet (counters lag), no token share") if lag else None,
                "probe_s": ps,
                "probe_time_share": (ps or 0.0) / interval if (probe or extra is not None) and interval
                else None}
        return {"kind": "sample", "i": self.n_samples, "t": t, "time": _now_iso(t), "interval_s": interval,
                "sample_s": t - t0, "accept_length": al, "accept_length_source": src,
                "accept_length_gauge": snap.get("accept_length_gauge"), "delta": d,
                "accept_rate_gauge": snap.get("accept_rate_gauge"),
                "uptime_s": uptime, "uptime_source": up_src, "kv_cache_use": snap.get("kv_cache_use"),
                "cache_hit_rate": hit, "cache_hit_rate_source": hit_src, "running_reqs": snap.get("running_reqs"),
                "queue_reqs": snap.get("queue_reqs"), "probe": probe, "probe_error": probe_error, "load": load,
                "server_restarted": restarted or None, "counters": {k: v for k, v in snap.items() if k != "sources"}}

    def _detect(self, rec: dict) -> Optional[DropDecision]:
        """The change point over the window, recorded in ``rec["change"]`` / ``rec["decision"]``."""
        w = [x for x in self.window if x["accept_length"] is not None]
        cp = change_point([x["accept_length"] for x in w], min_segment=self.s.min_segment, seed=self.n_samples)
        if cp is None:
            rec["change"] = None
            return None
        base = self.baseline
        ref = base if base is not None else cp.before
        decision = decide_drop(cp, material=self.s.material(ref), alpha=self.s.alpha, below=self.s.drop_below,
                               frac=self.s.drop_frac if base is not None else None, baseline=base)
        if self.s.drop_frac is not None and base is None:
            decision = DropDecision(False, f"no trigger: the baseline needs {self.s.baseline_n} samples",
                                    cp, decision.material, None, decision.conditions)
        if (decision.trigger and self.last_trigger_t is not None
                and rec["t"] - self.last_trigger_t < self.s.cooldown_s):
            decision = DropDecision(False, f"no trigger: cooldown ({rec['t'] - self.last_trigger_t:.0f} s of "
                                    f"{self.s.cooldown_s:.0f} s since the last drop)", cp, decision.material,
                                    base, decision.conditions)
        covs = covariate_steps([x["accept_length"] for x in w], {c: [x[c] for x in w] for c in COVARIATES},
                               cp.index, uptime=[x["uptime_s"] for x in w])
        lo, hi = cp.index_ci
        rec["change"] = {**cp.to_json(), "i": w[cp.index]["i"], "t": w[cp.index]["t"],
                         "i_ci": [w[lo]["i"], w[min(hi, len(w) - 1)]["i"]],
                         "t_ci": [w[lo]["t"], w[min(hi, len(w) - 1)]["t"]], **covs}
        rec["decision"] = {"trigger": decision.trigger, "reason": decision.reason, "material": decision.material,
                           "baseline": base}
        return decision

    def _trigger(self, decision: DropDecision, rec: dict) -> None:
        self.n_drops += 1
        self.last_trigger_t = rec["t"]
        reset_from = rec["change"]["i"]
        self.log.append({"kind": "drop", "n": self.n_drops, "t": rec["t"], "time": rec["time"], "i": rec["i"],
                         "reset_from": reset_from, "decision": decision.to_json(),
                         "change": rec["change"], "action": "investigate" if self.on_drop else "record"})
        self._reset_window(reset_from)
        if self.on_drop is not None:
            t0 = self.clock()
            try:
                out = self.on_drop(self.n_drops, decision)
                self.log.append({"kind": "investigation", "n": self.n_drops, "t": self.clock(),
                                 "seconds": self.clock() - t0, **(out or {})})
            except Exception as exc:         # noqa: BLE001 - recorded; the watch goes on (signals propagate)
                self.log.append({"kind": "investigation", "n": self.n_drops, "t": self.clock(),
                                 "seconds": self.clock() - t0, "error": f"{type(exc).__name__}: {exc}"[:500]})
            except BaseException as exc:     # a signal: the investigation's line says so, then the signal goes on
                self.log.append({"kind": "investigation", "n": self.n_drops, "t": self.clock(),
                                 "seconds": self.clock() - t0, "verdict": "interrupted",
                                 "error": (str(exc) or type(exc).__name__)[:300]})
                raise
            # the investigation took the server's time: the next interval starts now
            self.prev = None
            self.prev_t = None


def format_line(rec: dict) -> str:
    """The terminal line of one sample (``helpers.cli.common.progress_line`` prints it)."""
    def f(x: Any, spec: str = ".2f", pct: bool = False) -> str:
        v = _finite(x)
        return "-" if v is None else (f"{100 * v:.0f}%" if pct else format(v, spec))

    up = _finite(rec.get("uptime_s")) or 0.0
    h, rem = divmod(int(up), 3600)
    d = rec.get("delta") or {}
    probe = rec.get("probe") or {}
    load = rec.get("load") or {}
    ch = rec.get("change") or {}
    dec = rec.get("decision") or {}
    share = load.get("probe_token_share")
    tok_share = "counters lag" if load.get("counters_lag") else "-" if share is None else f(share, ".2%")
    change = ("change: -" if not ch else
              f"change at #{ch.get('i')} {f(ch.get('before'))}->{f(ch.get('after'))} p {ch.get('p_value', 1):.3g}"
              + (" DROP" if dec.get("trigger") else ""))
    src = {"counters": f"{f(d.get('generation_tokens'), '.0f')} tok/{f(d.get('verify_steps'), '.0f')} verify",
           "probe": "probe", "gauge": "gauge"}.get(rec.get("accept_length_source"), "no data")
    return (f"#{rec.get('i')} up {h}h{rem // 60:02d}m  accept length {f(rec.get('accept_length'))} ({src})  "
            f"probe {f(probe.get('accept_length'))}  KV {f(rec.get('kv_cache_use'), pct=True)}  "
            f"hit {f(rec.get('cache_hit_rate'), pct=True)}  running {f(rec.get('running_reqs'), '.0f')}  "
            f"load {tok_share}"
            f" tok / {f(load.get('probe_time_share'), '.2%') if load.get('probe_time_share') is not None else '-'}"
            f" time  {change}" + (f"  probe error: {rec['probe_error'][:80]}" if rec.get("probe_error") else "")
            + (f"  WARNING {rec['warning']}" if rec.get("warning") else "")
            + (f"  EVENT {', '.join(rec['events'])}" + (f" -> check-draft {rec['check']}" if rec.get("check") else "")
               if rec.get("events") else ""))


def run_loop(watcher: Watcher, *, interval: float, samples: Optional[int] = None, duration: Optional[float] = None,
             show: Callable[[str], None] = lambda line: None, max_failures: int = 3,
             sleep: Callable[[float], None] = time.sleep) -> str:
    """Sample every ``interval`` seconds until ``samples`` samples succeeded or ``duration`` seconds passed (None:
    until a signal); each sample's line goes to ``show``. A sample that fails is an ``error`` line and the watch goes
    on (a failed attempt is no sample: it does not count toward ``samples``), unless ``max_failures`` fail in a row
    (the last error is raised, whatever ``samples`` says). Returns why it stopped.

    Raises:
        the sample's error after ``max_failures`` failures in a row; :class:`helpers.errors.SGLangError` when the run
        ends (``duration``) with no sample that succeeded; :class:`helpers.errors.Interrupted` on a signal (the
        caller writes the ``stop`` line)."""
    start = watcher.clock()
    taken, failures, attempts = 0, 0, 0
    last_error: Optional[str] = None
    next_t = start
    while True:
        attempts += 1
        try:
            rec = watcher.step()
            failures = 0
            taken += 1
            show(format_line(rec))
        except Exception as exc:             # noqa: BLE001 - recorded; after max_failures the error goes on
            failures += 1
            last_error = f"{type(exc).__name__}: {exc}"[:500]
            watcher.log.append({"kind": "error", "t": watcher.clock(), "time": _now_iso(watcher.clock()),
                                "error": last_error, "in_a_row": failures})
            show(f"sample failed ({failures} in a row): {exc}")
            if failures >= max_failures:
                raise
        if samples is not None and taken >= samples:
            return f"{taken} sample(s) taken (--samples)"
        next_t += interval
        now = watcher.clock()
        if duration is not None and next_t - start > duration:
            if not taken:
                raise SGLangError(f"no sample succeeded in {duration:g} s (--duration), {attempts} attempt(s); the "
                                  f"last error: {last_error}", endpoint="/metrics")
            return f"{duration:g} s watched (--duration)"
        if next_t > now:
            sleep(next_t - now)
        else:                                # a slow sample or an investigation: do not catch up in a burst
            next_t = now


def start_record(*, url: str, engine: str, version: Optional[str], settings: WatchSettings, interval: float,
                 probe: Optional[dict], resumed: bool, argv: Sequence[str], extra: Optional[dict] = None) -> dict:
    """The ``start`` line of a run (or of a resume)."""
    t = time.time()
    s = {k: v for k, v in vars(settings).items() if k != "material"}
    return {"kind": "start", **FORMAT, "t": t, "time": _now_iso(t), "url": url, "engine": engine,
            "engine_version": version, "interval_s": interval, "probe": probe, "settings": s, "resumed": resumed,
            "argv": list(argv), **(extra or {})}
