"""Lifecycle events a client can observe that may change the served draft (``watch``; each event can start
``investigate --check-draft``: ``watch --on-event check-draft``).

What SGLang 0.5.23 lets a client see, read from its source (``sglang/srt/...``):

* ``/server_info`` ``startup_time`` (``entrypoints/http_server.py::server_info``): not a time of day but the start's
  phase durations (``managers/tokenizer_manager.py::set_startup_time``, from ``entrypoints/engine.py``: load_weight,
  kv_cache_allocation, ... in seconds), compared whole: another process has other durations (a restart, a
  replacement behind the URL);
* ``/model_info`` ``weight_version`` and ``model_path`` (``entrypoints/http_server.py::model_info``: "fields the
  control plane changes after publication"): ``/update_weights_from_disk`` moves ``model_path`` (and, its runner
  selector being ``all`` -- ``scheduler_components/weight_updater.py::WeightUpdater.update_weights_from_disk`` calls
  ``_select_runners()`` -- loads that one ``model_path`` into the draft runner too: on the reference server the
  target's files into the EAGLE-3 draft fail ``layers/linear.py`` ``weight_loader``'s shape assertion and the
  scheduler dies, seen live 2026-12-03); every
  ``/update_weights_from_{disk,tensor,distributed}`` given a ``weight_version`` sets it
  (``managers/tokenizer_control_mixin.py::_update_weight_version_if_provided``), as ``/update_weight_version`` does;
* ``/metrics`` ``sglang:weight_load_duration_seconds{source}``: a gauge set at the end of each in-place weight update
  (``managers/scheduler_components/weight_updater.py::WeightUpdater._observe_weight_load`` ->
  ``observability/metrics_collector.py::observe_weight_load``), absent before the first: a new value is an update
  even without a weight version (:data:`helpers.engines.sglang.WATCH_METRICS` ``weight_load_s``, summed over sources);
* the cumulative counters going down (:class:`helpers.acceptance.watch.Watcher`: ``server_restarted``);
* ``/weights_checker`` with ``selector draft`` (:meth:`helpers.engines.base.EngineAdapter.draft_checksum`): the
  draft's own weights hashed; opt-in (``watch --draft-checksum``: one hash of the draft per interval in the
  scheduler's loop);
* nothing for ``/release_memory_occupation`` + ``/resume_memory_occupation`` (sleep / wake: no counter, no field;
  ``scheduler_components/weight_updater.py`` resumes the weights in place), which only **the fixed probe** shows:
  one greedy request of a fixed prompt per interval (:data:`FIXED_PROMPT`, the same 12 token ids as the
  ``served_draft`` probe's), its output tokens and verify steps; on a clean server its answer does not move, so a
  change is an event. A changed answer is asked again at once and counts only when the second answer repeats it
  (a prefix-cache eviction, which makes one cold answer unlike the cached ones, does not count).

The fingerprint of one sample (:meth:`Lifecycle.observe` + :func:`fingerprint`) is recorded in the sample line
(``lifecycle``); :func:`events` compares two. vLLM 0.32.0 has neither ``startup_time`` nor ``weight_version`` nor
the draft checksum: only its ``/metrics``' ``process_start_time_seconds`` (``start_time``) and the fixed probe.
"""
from __future__ import annotations

import hashlib
import time
from typing import Any, Callable, Optional

#: the fixed probe's prompt: token ids below every vocabulary this tool serves (the reference target's is 4096), also
#: the ``served_draft`` probe's input (:mod:`helpers.investigation.probes.trace`)
FIXED_PROMPT = (1, 450, 496, 1735, 1701, 432, 1720, 975, 278, 1736, 1120, 2988)
FIXED_NEW_TOKENS = 16
#: fingerprint field -> the event its change is (in the order reported)
EVENTS = {"startup_time": "server_restarted", "start_time": "server_restarted",
          "weight_version": "weight_version_changed", "model_path": "model_path_changed",
          "weight_load_s": "weights_loaded", "draft_checksum": "draft_checksum_changed",
          "answer": "probe_answer_changed"}
#: fields whose first appearance (None -> a value) is itself the event: the weight-load gauge exists only after one
APPEARS = ("weight_load_s",)
#: fingerprint field -> the observation (:class:`Lifecycle` source) it is read from; a field whose read failed keeps
#: the last value read (listed in the fingerprint's ``carried``), so a change across a failed read is still an event
SOURCE_OF = {"startup_time": "server_info", "weight_version": "model_info", "model_path": "model_info",
             "answer": "answer", "draft_checksum": "checksum"}


def answer_key(output_ids: Any, verify_ct: Any) -> dict:
    """The fixed probe's answer as compared: ``{"tokens": n, "output_sha": first 16 hex of sha256 over the ids,
    "verify_ct": verify steps}``."""
    ids = [int(t) for t in (output_ids or [])]
    sha = hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()[:16]
    return {"tokens": len(ids), "output_sha": sha, "verify_ct": None if verify_ct is None else int(verify_ct)}


def fixed_answer(client: Any, *, timeout: float) -> dict:
    """The fixed probe (module docstring): one greedy request of :data:`FIXED_PROMPT` for :data:`FIXED_NEW_TOKENS`
    tokens (``client.generate``, every engine's client contract), as :func:`answer_key`.

    Raises what ``generate`` raises past ``timeout`` seconds."""
    r = client.generate(input_ids=list(FIXED_PROMPT), max_new_tokens=FIXED_NEW_TOKENS, timeout=float(timeout),
                        sampling_params={"temperature": 0.0, "ignore_eos": True})
    return answer_key(r.output_ids, r.meta_info.spec_verify_ct)


def fingerprint(*, server_info: Optional[dict] = None, model_info: Optional[dict] = None,
                snapshot: Optional[dict] = None, answer: Optional[dict] = None,
                draft_checksum: Optional[str] = None, errors: Optional[dict] = None) -> dict:
    """One sample's lifecycle fingerprint: the fields of :data:`EVENTS` (None where not observed) and ``errors``
    (source -> why it could not be read)."""
    si, mi, sn = server_info or {}, model_info or {}, snapshot or {}
    return {"startup_time": si.get("startup_time"), "start_time": sn.get("start_time"),
            "weight_version": mi.get("weight_version"), "model_path": mi.get("model_path"),
            "weight_load_s": sn.get("weight_load_s"), "draft_checksum": draft_checksum, "answer": answer,
            "errors": dict(errors or {})}


def events(before: Optional[dict], now: dict) -> list[dict]:
    """The events between two fingerprints: ``[{"event", "field", "before", "after"}]``, one per event name (the
    first field that shows it). A field counts when both values are known and differ, or for :data:`APPEARS` when
    it appears; a field that could not be read (None) is no event. No events without a ``before``. A ``before``
    whose field was carried over a failed read (its ``carried``: :meth:`Lifecycle.finish`) holds the last value read:
    the event compares with it and says (``note``) that a read failed in between."""
    if not before:
        return []
    out, seen = [], set()
    carried = set(before.get("carried") or ())
    for fld, name in EVENTS.items():
        a, b = before.get(fld), now.get(fld)
        if b is None or a == b or (a is None and fld not in APPEARS) or name in seen:
            continue
        seen.add(name)
        ev = {"event": name, "field": fld, "before": a, "after": b}
        if fld in carried:
            ev["note"] = f"a read of {fld} failed in between: compared with the last value read"
        out.append(ev)
    return out


class Lifecycle:
    """The lifecycle observations of one watch run (module docstring). Each callable may be None (not observed):
    ``server_info()`` (a fresh ``/server_info``), ``model_info()`` (a fresh ``/model_info``), ``answer()`` (the
    fixed probe: ``answer_key`` of one greedy request of :data:`FIXED_PROMPT`), ``checksum()`` (the draft's weights
    checksum or None). ``last``: the previous fingerprint (restored by a resumed watch)."""

    def __init__(self, *, server_info: Optional[Callable[[], dict]] = None,
                 model_info: Optional[Callable[[], dict]] = None, answer: Optional[Callable[[], dict]] = None,
                 checksum: Optional[Callable[[], Optional[str]]] = None):
        self.sources = {"server_info": server_info, "model_info": model_info, "answer": answer,
                        "checksum": checksum}
        self.last: Optional[dict] = None
        self._tokens = 0

    def _read(self, name: str, errors: dict) -> Any:
        fn = self.sources[name]
        if fn is None:
            return None
        try:
            got = fn()
            if name == "answer" and isinstance(got, dict):
                self._tokens += int(got.get("tokens") or 0)
            return got
        except Exception as exc:          # noqa: BLE001 - an observation that fails is no event; signals propagate
            errors[name] = f"{type(exc).__name__}: {exc}"[:200]
            return None

    def _answer(self, errors: dict) -> tuple[Optional[dict], Optional[str]]:
        """The fixed probe's answer to record, and a note when it moved once without repeating."""
        a = self._read("answer", errors)
        ref = (self.last or {}).get("answer")
        if a is None:
            return None, None
        if ref is None or a == ref:
            if ref is None and self.last is None:
                again = self._read("answer", errors)      # the first answer may be cold: the cached one is the ref
                return (again or a), None
            return a, None
        again = self._read("answer", errors)
        if again == a:
            return a, None                                # repeated: a real change
        return ref, "the fixed probe's answer moved once and did not repeat (not counted)"

    def observe(self) -> dict:
        """The requests of one observation (before the sample's ``/metrics``, so their tokens count in this
        interval): returns the partial fingerprint for :meth:`finish`, with ``tokens`` (the fixed probe's generated
        tokens) and ``seconds`` (the observation's wall seconds): the watch's own load."""
        errors: dict = {}
        self._tokens, t0 = 0, time.monotonic()
        info = self._read("server_info", errors)
        model = self._read("model_info", errors)
        answer, note = self._answer(errors)
        checksum = self._read("checksum", errors)
        return {"server_info": info, "model_info": model, "answer": answer, "draft_checksum": checksum,
                "errors": errors, "note": note, "tokens": self._tokens, "seconds": time.monotonic() - t0}

    def finish(self, seen: dict, snapshot: dict) -> tuple[dict, list[dict]]:
        """The fingerprint of ``seen`` (:meth:`observe`) with the sample's ``/metrics`` ``snapshot``, and the events
        since the last one; the fingerprint becomes :attr:`last`. A field whose read failed (``errors``) keeps the
        last value read, listed in ``carried`` (:data:`SOURCE_OF`)."""
        fp = fingerprint(server_info=seen["server_info"], model_info=seen["model_info"], snapshot=snapshot,
                         answer=seen["answer"], draft_checksum=seen["draft_checksum"], errors=seen["errors"])
        if seen.get("note"):
            fp["note"] = seen["note"]
        last = self.last or {}
        carried = [f for f, src in SOURCE_OF.items()
                   if fp.get(f) is None and src in fp["errors"] and last.get(f) is not None]
        for f in carried:                 # a failed read keeps the last value read (module docstring)
            fp[f] = last[f]
        if carried:
            fp["carried"] = carried
        ev = events(self.last, fp)
        self.last = fp
        return fp, ev


def for_server(client: Any, adapter: Any, *, probe_timeout: float, request_timeout: float,
               draft_checksum: bool = False,
               bounded: Callable[[Callable, float, str], Callable] = lambda fn, seconds, flag: fn) -> Lifecycle:
    """The lifecycle observations of one server (``watch``'s): a fresh ``/server_info`` and ``/model_info`` (where
    the client has it), the fixed probe, and with ``draft_checksum`` the engine's draft checksum
    (:meth:`helpers.engines.base.EngineAdapter.draft_checksum`). ``bounded(fn, seconds, flag)`` puts each under its
    own deadline (``watch``: a fresh budget of the client per request)."""
    model_info = getattr(client, "model_info", None)
    checksum = None
    if draft_checksum:
        def read_checksum() -> Optional[str]:
            got = adapter.draft_checksum(client)
            return None if got is None else got["per_engine_checksum"]
        checksum = bounded(read_checksum, 3 * request_timeout, "--request-timeout")
    req = 2 * request_timeout
    return Lifecycle(server_info=bounded(lambda: client.server_info(refresh=True), req, "--request-timeout"),
                     model_info=bounded(lambda: model_info(refresh=True), req, "--request-timeout") if model_info
                     else None,
                     answer=bounded(lambda: fixed_answer(client, timeout=probe_timeout), probe_timeout + 1.0,
                                    "--probe-timeout"), checksum=checksum)


__all__ = ["APPEARS", "EVENTS", "SOURCE_OF", "FIXED_NEW_TOKENS", "FIXED_PROMPT", "Lifecycle", "answer_key", "events",
           "fingerprint", "fixed_answer", "for_server"]
