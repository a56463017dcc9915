"""Is the served draft its checkpoint? (``python -m helpers investigate --check-draft``; ``watch --on-event
check-draft``): attach, then only the served-draft checks, a verdict in one line.

What it runs, in order, on one deadline (``--timeout``):

1. **attach** (:func:`helpers.investigation.attach.attach`): what the server runs; a ``--draft`` whose files differ
   from the server's draft folder is ``served_draft_differs`` at once (the configs and weights named).
2. **weight evidence**: the engine's own hash of the draft's weights where it has one
   (:meth:`helpers.engines.base.EngineAdapter.draft_checksum`: SGLang 0.5.23's ``/weights_checker`` with ``selector
   draft``; ``/get_weights_by_name`` reaches the target only, :mod:`helpers.investigation.probes.trace`). The
   checksum is of the tensors as the engine holds them, so it is compared with a previous check's
   (``previous_checksum``: ``watch`` passes the last one it saw), never with the checkpoint's files: a change says
   the weights moved, not which are right.
3. **the served draft's proposals** (:data:`CHECK_PROBES`, run by :func:`helpers.investigation.probes.run_probes`
   with ``only``): ``served_draft`` (a fixed 12-token prompt) and ``step_trace`` (``prompts`` of the bundled set),
   every draft step the server proposed against the checkpoint's on the very states it fed. They need the server's
   draft step trace (``server start --trace-draft DIR``); without it both are skipped saying how to start it. An MTP /
   NextN head (SGLang ``NEXTN``) is checked the same way against its offline head
   (:func:`helpers.draft.loader.load_draft` -> :class:`helpers.draft.nextn.NextNHead`: the target folder's
   ``model.layers.{num_hidden_layers}.*``); a family with no offline head here (:data:`helpers.draft.loader.
   OFFLINE_HEADS`) stops at the attach with one line.

Verdict (``check_draft.json`` ``verdict``; :data:`EXIT` the CLI's exit code):

* ``differs`` (exit 1): a finding of :data:`DRAFT_FAULTS` (attach's folder comparison or a probe's step-1 /
  step-2 divergence);
* ``matches`` (exit 0): ``served_draft`` ran and is ``clear``, every other probe that ran is ``clear``, and the
  draft's weights checksum did not change since the previous check (or there is none to compare);
* ``undecided`` (exit 3): no probe could decide (not traced, the checkpoint not readable here, no speculative
  settings, a probe refused by the server or found nothing to align, another trace armed on the server), with why
  and how to get the evidence; or the probes are clear but the checksum changed (:func:`verdict_of`).

A server that fails (unreachable, 5xx, a malformed answer: also during a probe, ``run_probes(server_errors=True)``)
or the deadline raises (exit 1), bad input raises :class:`helpers.errors.BadInput` (exit 2); the run folder's
``check_draft.json`` is written in every case (``error`` says why when it raised). Each probe starts only with its
estimate plus :data:`helpers.investigation.probes.RESERVE_S` (60 s) left of ``--timeout``.
"""
from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Optional

from ..acceptance.prompts import load_prompts
from ..budget import Budget
from ..draft.loader import OFFLINE_HEADS
from ..engines.detect import detect
from ..errors import BadInput, ServerError, describe
from ..redaction import redact_url, url_label
from ..runfiles import safe_name, new_run_dir, write_json
from .attach import attach, mtp_not_supported, require_draft
from .probes import RESERVE_S, ProbeContext, least_timeout, probe_line, run_probes
from .probes.trace import SERVED_DRAFT, STEP_TRACE

#: the probes of the check, in the order they run
CHECK_PROBES = (SERVED_DRAFT.name, STEP_TRACE.name)
#: the finding kinds that make the verdict ``differs``
DRAFT_FAULTS = ("served_draft_differs", "draft_kv_diverges", "draft_extend_ids_unshifted")
#: the CLI's exit code of each verdict
EXIT = {"matches": 0, "differs": 1, "undecided": 3}
DOC_NAME = "check_draft.json"
FORMAT = {"format": "e3f-check-draft", "version": 1}


def _noop(_: str) -> None:
    pass


def default_run_dir(out: Optional[str | Path], url: str) -> Path:
    """A new run folder ``<out or outputs>/<stamp>-check-draft-<host-port>/`` (no credentials of the URL)."""
    return new_run_dir(f"check-draft-{safe_name(url_label(url))}", out)


def weight_evidence(adapter: Any, client: Any, previous: Optional[str] = None) -> dict:
    """The engine's checksum of the served draft's weights (:meth:`EngineAdapter.draft_checksum`) as
    ``{"checksum": str | None, "ranks": [...], "source", "changed": bool | None, "previous", "note"}``; ``changed``
    compares with ``previous`` (None without one). A failing endpoint is a ``note``, never the check's failure (the
    proposals decide)."""
    try:
        got = adapter.draft_checksum(client)
    except ServerError as exc:
        return {"checksum": None, "note": f"the engine's draft checksum failed: {str(exc).splitlines()[0][:200]}"}
    if got is None:
        return {"checksum": None, "note": f"{getattr(adapter, 'label', 'the engine')} reports no checksum of the "
                                          "draft's weights (SGLang 0.5.23: POST /weights_checker)"}
    cs = got["per_engine_checksum"]
    changed = None if previous is None else cs != previous
    note = (None if changed is None else
            f"the draft's weights checksum {'changed' if changed else 'is unchanged'} since the previous check")
    return {"checksum": cs, "ranks": got.get("ranks"), "source": got.get("source"), "previous": previous,
            "changed": changed, "note": note}


def _line(r: dict) -> str:
    """One probe's result with its reason (``probe_line`` with the decision's ``why``)."""
    if r.get("status") == "ran" and r.get("decision") and r.get("why"):
        return f"{r['probe']} ({r['condition']}): {r['decision']}: {r['why']}"
    return probe_line(r)


def check_timeout(timeout: Optional[float], prompts: int, max_new_tokens: int, flag: str = "--timeout", *,
                  least: bool = True) -> None:
    """Refuse a deadline the check cannot use, before any request or folder: not a finite number of seconds above 0
    (nan, inf), or below :func:`helpers.investigation.probes.least_timeout` of :data:`CHECK_PROBES` (each probe
    starts only with its estimate plus :data:`helpers.investigation.probes.RESERVE_S` left, so every probe would be
    skipped and the check could only be undecided; ``least=False``: the finite check only, as :func:`check_draft`
    does for ``watch``, whose ``--check-timeout`` is its own flag's to check up front). None: no deadline.

    Raises:
        BadInput: naming ``flag`` and the least deadline that runs a probe."""
    if timeout is None:
        return
    if not (isinstance(timeout, (int, float)) and 0 < timeout < float("inf")):
        raise BadInput(f"expected a finite number of seconds above 0, got {timeout}", field=flag)
    if not least:
        return
    need = least_timeout(CHECK_PROBES, SimpleNamespace(prompts=[None] * prompts, max_new_tokens=max_new_tokens))
    if timeout < need:
        raise BadInput(f"{timeout:g} s is too short for any probe of the check: give at least {need:.0f} s (the "
                       f"cheapest probe's estimate plus the {RESERVE_S:.0f} s every probe leaves for the run's end)",
                       field=flag)


def verdict_of(state: dict, findings: list, weights: Optional[dict] = None) -> tuple[str, str]:
    """``(verdict, reason)`` from the probes' state (:func:`run_probes`), the findings and the weight evidence
    (:func:`weight_evidence`; module docstring).

    A checksum that changed since the previous check never lets the verdict be ``matches``; it is ``undecided``
    (with why), not ``differs``: the checksum hashes the tensors as the engine holds them (fused, TP-sharded, its
    dtype), and the check is given only the previous checksum, not the engine state it was taken in, so it cannot
    tell a draft whose weights moved under a running server (a fault) from a restart with another layout or a
    weight update (a change of state: ``watch`` checks on exactly those events), while clear proposals on a few
    prompts do not rule out a change in weights they do not exercise (rows of tokens never proposed). Findings of
    the probes still make it ``differs``."""
    bad = [f for f in findings if f.get("kind") in DRAFT_FAULTS]
    if bad:
        return "differs", f"{bad[0]['kind']}: {str(bad[0].get('detail') or '')[:300]}"
    rows = {r["probe"]: r for r in state.get("probes") or []}
    ran = [r for r in rows.values() if r["status"] == "ran"]
    sd = rows.get(SERVED_DRAFT.name)
    if sd and sd["status"] == "ran" and sd["decision"] == "clear" and all(r["decision"] == "clear" for r in ran):
        if (weights or {}).get("changed"):
            return "undecided", (f"the draft's weights checksum changed since the previous check "
                                 f"({str(weights.get('previous'))[:16]} -> {str(weights.get('checksum'))[:16]}) while "
                                 "its proposals match the checkpoint: a weight update or restart explains it, a "
                                 "fault in weights the prompts do not exercise would too; if the server was updated "
                                 "or restarted, check again to take this checksum as the reference; "
                                 + "; ".join(_line(r) for r in ran))
        return "matches", "; ".join(_line(r) for r in ran)
    open_ = [r for r in rows.values() if not (r["status"] == "ran" and r["decision"] == "clear")]
    return "undecided", "; ".join(_line(r) for r in open_) or "no probe of the check ran"


def check_draft(url: str, *, run_dir: str | Path, draft: Optional[str | Path] = None,
                target: Optional[str | Path] = None, api_key: Optional[str] = None, timeout: Optional[float] = 300.0,
                prompts: int = 3, max_new_tokens: int = 16, previous_checksum: Optional[str] = None,
                progress: Callable[[str], None] = _noop) -> dict:
    """Check the served draft of the server at ``url`` against its checkpoint (module docstring) into ``run_dir``.

    Args:
        url: the server's base URL; api_key: its API key (never written); timeout: the check's one deadline (s).
        run_dir: the run folder (created when missing; one that already holds a ``check_draft.json`` is refused).
        draft / target: folders to use when the server's are not readable here (as ``investigate``'s).
        prompts / max_new_tokens: the ``step_trace`` probe's bundled prompts and tokens per prompt.
        previous_checksum: the draft weights checksum of an earlier check (``watch``), to say whether it moved.
        progress: one line per step.

    Returns:
        the document written to ``run_dir/check_draft.json``: ``verdict`` (``matches`` / ``differs`` /
        ``undecided``), ``reason`` (one line), ``exit`` (:data:`EXIT`), ``findings``, ``engine_state`` (the probes'
        results), ``weights`` (:func:`weight_evidence`), ``attach``, ``notes``, ``seconds``, ``run_dir``.

    Raises:
        BadInput: a run folder that holds a check, a draft or target folder without config.json, a server with no
            draft readable here and no ``draft``, a ``timeout`` refused by :func:`check_timeout`; ServerError: the
            server fails (also during a probe: unreachable, 5xx, a malformed answer) or the deadline runs out.
    """
    run_dir = Path(run_dir)
    if (run_dir / DOC_NAME).exists():
        raise BadInput(f"the run folder already holds a check ({DOC_NAME}); check into a new run folder",
                       path=run_dir)
    if prompts < 1 or max_new_tokens < 2:
        raise BadInput(f"the check needs >= 1 prompt and >= 2 tokens per prompt, got {prompts} and {max_new_tokens}",
                       field="--prompts/--max-new-tokens")
    check_timeout(timeout, prompts, max_new_tokens, least=False)
    run_dir.mkdir(parents=True, exist_ok=True)
    t0, dl = time.monotonic(), Budget(timeout, flag="--timeout")
    doc: dict = {**FORMAT, "url": redact_url(url), "run_dir": str(run_dir), "verdict": None, "reason": None,
                 "exit": None, "findings": [], "engine_state": None, "weights": None, "attach": None, "notes": [],
                 "error": None}
    client = None
    try:
        adapter = detect(url, api_key, budget=dl).adapter
        client = adapter.client(url, api_key, timeout=min(600.0, timeout or 600.0), budget=dl)
        att = attach(client, draft=draft, target=target, caveats=adapter.capture_caveats)
        doc["attach"] = att.to_json()
        progress(f"attach: {adapter.label} {att.version}, {att.algorithm}, draft {att.draft_dir} [{att.draft_source}]")
        if att.draft_head is not None and att.draft_head.get("family") not in OFFLINE_HEADS:
            # an MTP head with no offline head here; a NextN head's probes replay it (helpers.draft.nextn.NextNHead)
            raise BadInput(mtp_not_supported(att.draft_head, att.draft_dir, att.target_dir), field="draft")
        require_draft(att)
        doc["weights"] = weight_evidence(adapter, client, previous_checksum)
        if doc["weights"].get("note"):
            doc["notes"].append(doc["weights"]["note"])
        progress(f"weights: checksum {doc['weights'].get('checksum') or '-'}"
                 + (f" ({doc['weights']['note']})" if doc["weights"].get("note") else ""))
        findings = [f for f in att.findings if f.get("kind") in DRAFT_FAULTS]
        if not (att.spec or {}).get("num_steps"):
            state = {"asked": "check-draft", "probes": [], "findings": [], "notes": [], "seconds": 0.0}
            doc["notes"].append("the server reports no speculative settings: no draft step to check")
        else:
            ctx = ProbeContext(client=client, adapter=adapter, att=att, run_dir=run_dir,
                               prompts=load_prompts(None, n=prompts), max_new_tokens=max_new_tokens, dl=dl,
                               progress=progress, api_key=api_key)
            state = run_probes(ctx, "cheap", only=CHECK_PROBES, server_errors=True)
            doc["notes"] += state["notes"]
        doc["engine_state"] = state
        doc["findings"] = findings + list(state["findings"])
        doc["verdict"], doc["reason"] = verdict_of(state, doc["findings"], doc["weights"])
        doc["exit"] = EXIT[doc["verdict"]]
    except BaseException as exc:         # a server, the deadline, a signal: the record says why, then it goes on
        doc["error"] = describe(exc)
        raise
    finally:
        if client is not None:
            client.close()
        doc["seconds"] = round(time.monotonic() - t0, 2)
        write_json(run_dir / DOC_NAME, doc)
    return doc


def verdict_line(doc: dict) -> str:
    """The check's terminal line: ``served draft <verdict>: <reason> (<seconds> s)``."""
    return f"served draft {doc.get('verdict')}: {doc.get('reason')} ({doc.get('seconds', 0):.1f} s)"


__all__ = ["CHECK_PROBES", "DOC_NAME", "DRAFT_FAULTS", "EXIT", "check_draft", "check_timeout", "default_run_dir",
           "verdict_line", "verdict_of", "weight_evidence"]
