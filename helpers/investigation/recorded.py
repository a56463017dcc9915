"""Recorded cases (:class:`helpers.investigation.cases.RecordedCase`): a live server with a fault, investigated blind
once by :func:`helpers.investigation.live.investigate`, its ``investigation.json`` kept in the repository
(``recording``), and replayed offline from there: the postmortem of the README's main job shows it beside its own live
case without starting a server (no server start-up, no live capture: what keeps the main job's wall time).

* :func:`record_case` -- start the embedded SGLang server the case describes (e.g. the Kimi-class target drafting with
  its own NextN head, ``--speculative-algorithm NEXTN``, the fault injected through ``--forward-hooks`` on the
  target's logits processor: :func:`helpers.capture.server_hook_specs`), investigate it, write the recording
  (``investigation.json`` as the tool wrote it, ``recording.json``: when, where, how long, the machine's load, the
  launch), stop the server.
* :func:`replay_recorded` -- read the recording back, checked against the case (the launch recorded is the case's).
* the postmortem section of one recorded case is :func:`helpers.views.recorded.recorded_parts` (every text
  HTML-escaped).
"""
from __future__ import annotations

import json
import os
import platform
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

from ..errors import CaseError
from ..paths import ROOT
from ..records import InvestigationDoc
from ..runfiles import read_json_file, write_json
from .cases import RecordedCase, load_recorded_case

#: the two files of a recording folder
DOC, META = "investigation.json", "recording.json"


def _launch(case: RecordedCase) -> dict:
    """What the case starts, as recorded in ``recording.json`` ``launch`` (compared by :func:`replay_recorded`)."""
    return {"target": case.target, "tp": case.server.tp, "spec": case.server.spec.model_dump(mode="json",
                                                                                            exclude_none=True),
            "faults": [dict(f) for f in case.faults], "extra_args": list(case.server.extra_args),
            "prompts": case.investigate.prompts, "max_new_tokens": case.investigate.max_new_tokens}


def record_case(case_path: str | os.PathLike, *, timeout: float = 1200.0,
                progress: Callable[[str], None] = lambda s: None) -> Path:
    """Record a case: start its server (embedded SGLang 0.5.23, float32, ``case.server``, the case's faults through
    ``--forward-hooks``), run the blind investigation on it (HF every-layer reference, no training data, no fix
    applied, no engine-state probe), write ``case.recording``/``investigation.json`` and ``recording.json``, stop the
    server.

    Returns: the recording folder. Raises: CaseError (bad case file), BadServerInput / ServerStartError (the server),
    ServerError (the investigation's requests); the server never outlives the call."""
    from ..acceptance.machine import LoadSampler  # lazy: recording only (the page reads a recording)
    from ..capture import server_hook_specs  # lazy: recording only (the page reads a recording)
    from ..formats.configs import read_target_config  # lazy: recording only (the page reads a recording)
    from ..hooks import model_family  # lazy: recording only (the page reads a recording)
    from ..server.embedded import start  # lazy: recording only (the page reads a recording)
    from .live import investigate  # lazy: recording only (the page reads a recording)

    case = load_recorded_case(case_path)
    target = case.resolve(case.target)
    tcfg = read_target_config(target)
    hooks = server_hook_specs(tcfg.num_hidden_layers, faults=case.faults,
                              family=model_family(tcfg.architectures, tcfg.model_type))
    out = case.resolve(case.recording)
    with tempfile.TemporaryDirectory(prefix="e3f-record-") as tmp:
        t0 = time.monotonic()
        progress(f"starting the server ({case.server.spec.algorithm}, TP {case.server.tp}, faults {case.faults})")
        handle = start(target, None, tp=case.server.tp, spec=case.server.spec, extra_args=case.server.extra_args,
                       forward_hooks=hooks, timeout=timeout, log_path=Path(tmp) / "server.log")
        try:
            start_s = time.monotonic() - t0
            progress(f"server ready in {start_s:.1f} s at {handle.url}; investigating")
            with LoadSampler() as load:
                t1 = time.monotonic()
                doc = investigate(handle.url, training=None, run_dir=Path(tmp) / "run",
                                  measure_prompts=case.investigate.prompts,
                                  max_new_tokens=case.investigate.max_new_tokens, timeout=timeout, apply_fix=False,
                                  engine_probes="none")
                inv_s = time.monotonic() - t1
        finally:
            handle.stop()
        out.mkdir(parents=True, exist_ok=True)
        rec = json.loads((Path(tmp) / "run" / DOC).read_text())
    rec["run_dir"] = case.recording        # the temporary run folder is gone; the recording is what is kept
    write_json(out / DOC, checkout_relative(rec))
    write_json(out / META, {
        "case": os.fspath(Path(case_path)), "recorded_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "server_start_s": round(start_s, 1), "investigation_s": round(inv_s, 1), "verdict": doc.verdict,
        "machine": {**load.result, "host_cpus": os.cpu_count(), "platform": platform.platform()},
        "launch": _launch(case), "engine_version": doc.engine_version,
        "command": f".venv/bin/python -m helpers replay --record {os.fspath(case_path)}"})
    return out


def checkout_relative(rec: Any) -> Any:
    """``rec`` (parsed JSON) with every string's ``<this checkout>/`` prefix dropped: a recording names the models
    as ``env/models/...``, not as the folder of the checkout that recorded it."""
    prefix = os.fspath(ROOT) + os.sep
    return json.loads(json.dumps(rec).replace(json.dumps(prefix)[1:-1], ""))


def replay_recorded(case: RecordedCase | str | os.PathLike) -> tuple[InvestigationDoc, dict]:
    """The recorded investigation of a case and its ``recording.json``, read offline (nothing is started).

    Returns: ``(doc, meta)``.

    Raises:
        CaseError: the recording folder or one of its two files is missing or not valid, or its recorded launch is
            not the case's (the case file was edited after the recording: record it again), naming the file."""
    if not isinstance(case, RecordedCase):
        case = load_recorded_case(case)
    folder = case.resolve(case.recording)
    try:
        meta = read_json_file(folder / META, "recording")
        doc = InvestigationDoc.model_validate(read_json_file(folder / DOC, "recorded investigation"))
    except (OSError, ValueError) as exc:
        raise CaseError(f"{folder}: not a recording of case '{case.name}' ({exc}); record it with "
                        f"`.venv/bin/python -m helpers replay --record CASE.yaml`") from None
    want, got = _launch(case), (meta or {}).get("launch")
    if got != want:
        diff = sorted(k for k in set(want) | set(got or {}) if (got or {}).get(k) != want.get(k))
        raise CaseError(f"{folder / META}: recorded launch differs from case '{case.name}' in {diff}: record it again "
                        f"with `.venv/bin/python -m helpers replay --record CASE.yaml`")
    return doc, meta


def recorded_headline(doc: InvestigationDoc, meta: dict) -> str:
    """One plain-text line: the finding the recorded investigation named (or its verdict), the NextN / draft budget's
    sentence, and when and where it was recorded."""
    first = doc.findings[0] if doc.findings else None
    what = f"{first.kind}: {first.detail}" if first else f"no finding (verdict {doc.verdict})"
    m = meta.get("machine") or {}
    load = m.get("loadavg_before")
    return (f"{what}. Recorded {meta.get('recorded_at')} on SGLang {meta.get('engine_version') or '?'} "
            f"({m.get('cpu_count')} CPUs, 1-min load {load[0] if load else '?'}): server start-up "
            f"{meta.get('server_start_s')} s, investigation {meta.get('investigation_s')} s; replayed here from the "
            f"recording, no server started.")


__all__ = ["DOC", "META", "checkout_relative", "record_case", "recorded_headline", "replay_recorded"]
