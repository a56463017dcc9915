"""Ablations and workload sweeps of one server (``python -m helpers ablate``, the investigation's sweep step, the
``21_ablate`` page): the workload sweeps of :mod:`helpers.acceptance.sweeps` on the running server, then the engine
toggles of :mod:`helpers.acceptance.ablations` on restarted copies of it, each against the unchanged server with a
paired CI over the same prompts, all under one time budget; what they show becomes findings with their cause
(``workload``: the requests, not the server; ``engine``: an engine feature).

Written into the run folder: ``results/ablate.json`` (:func:`ablate`'s document) and every measurement under
``ablate/<sweep or toggle>/<point>/`` (``summary.json``, ``per_request.parquet``, ``positions.csv``).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from ..acceptance.ablations import Toggle, flag_text
from ..acceptance.measure import measure
from ..acceptance.prompts import load_prompts
from ..acceptance.stats import format_ci, paired_effect
from ..acceptance.sweeps import MATERIAL, MIN_TOKENS, SUMMARY_KEYS, SWEEPS, Point, run_sweep, trend
from ..budget import Budget
from ..diagnosis.detectors import finding
from ..draft.config_checks import derived_context, draft_text_config, text_config
from ..draft.training_log import find_training_log
from ..errors import BadInput, ServerError, describe
from ..formats.configs import read_draft_config, read_target_config
from ..runfiles import read_json_file, safe_name, write_json
from ..engines.base import EngineAdapter
from ..engines.detect import BY_NAME as BY_ENGINE, adapter as adapter_named, detect
from ..engines.sglang import SGLangAdapter
from ..server.client import ServerClient
from ..server.registry import lookup
from ..server.restart import relaunch_argv

FORMAT = "e3f-ablate"
#: seconds a toggle is assumed to take (restart + one measurement) before one was measured: a toggle is not started
#: with less budget left (the embedded TP 1 server restarts and is measured in 40-65 s on 2 shared cores)
FIRST_TOGGLE_S = 60.0
#: finding kind -> cause of each sweep's fall
SWEEP_KINDS = {"context": ("context_loses_acceptance", "workload"),
               "temperature": ("temperature_loses_acceptance", "workload"),
               "concurrency": ("concurrency_loses_acceptance", "engine")}


def limits(info: dict, *, draft_dir: Optional[Path] = None, target_dir: Optional[Path] = None,
           training_log: Optional[Path] = None) -> dict:
    """Context limits in tokens, each with its source: ``target`` (``--context-length`` of ``/server_info``, else the
    target config's derived context length), ``draft`` (the draft config's derived context length; SGLang 0.5.23
    raises a shorter one to the target's context only when ``SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1``,
    ``sglang/srt/configs/model_config.py::ModelConfig._derive_context_length``) -- both read as SGLang derives them
    (:func:`helpers.draft.config_checks.derived_context`: ``max_position_embeddings`` or its aliases, times the rope
    factor), ``training`` (mean tokens per training sample, from the training log's data manifest). Unreadable
    sources are left out."""
    out: dict[str, Any] = {"sources": {}}
    n = info.get("context_length")
    if isinstance(n, int) and not isinstance(n, bool) and n > 0:     # a server may say anything: a string, -5
        out["target"], out["sources"]["target"] = n, "/server_info context_length"
    for key, d, reader in (("target", target_dir, read_target_config), ("draft", draft_dir, read_draft_config)):
        if key in out or d is None:
            continue
        try:
            cfg = reader(d)
            ctx = derived_context(draft_text_config(cfg)[0] if key == "draft" else text_config(cfg.raw))
        except BadInput:
            continue
        if isinstance(ctx["value"], int) and ctx["value"] > 0:
            out[key], out["sources"][key] = ctx["value"], f"{Path(d) / 'config.json'} {ctx['field']}"
    if training_log is not None:
        try:
            raw = read_json_file(training_log, what="training log")
        except BadInput:
            raw = None
        man = ((raw or {}).get("data") or {}).get("manifest") if isinstance(raw, dict) else None
        if isinstance(man, dict) and man.get("tokens") and man.get("samples"):
            out["training"] = int(man["tokens"] / man["samples"])
            out["sources"]["training"] = f"{training_log} data.manifest (tokens / samples)"
    return out


def _save(res, run_dir: Path, *parts: str) -> Optional[str]:
    try:
        return str(res.save(run_dir.joinpath("ablate", *[safe_name(p) for p in parts])).relative_to(run_dir))
    except OSError:
        return None


def sweep_finding(t: dict, lim: dict, sampling_rule: Optional[str] = None) -> dict:
    """The finding of a sweep whose acceptance falls (:func:`helpers.acceptance.sweeps.trend`), with what the data and
    the configs say of where it begins; it names no limit the data do not support. ``sampling_rule``: how the server's
    engine verifies sampled tokens (``EngineAdapter.sampling_rule``), said for the temperature sweep."""
    kind, cause = SWEEP_KINDS[t["sweep"]]
    ci = t["ci"]
    head = (f"accept length falls from {t['reference_accept_length']:.2f} ({t['reference']}) to "
            f"{t['at_accept_length']:.2f} ({t['at']}), paired change {t['delta']:+.2f} [{ci[0]:+.2f}, {ci[1]:+.2f}] "
            f"over the same prompts; it holds up to {t['last_ok']} and falls from {t['first_falling']}")
    where = []
    if t["sweep"] == "context":
        d, tr = lim.get("draft"), lim.get("training")
        if t.get("past_draft_limit"):
            where.append(f"the fall begins past the draft's max_position_embeddings {d} "
                         f"({lim['sources'].get('draft')})")
        elif d and d < (t.get("last_ok_value") or 0):
            where.append(f"the draft config's max_position_embeddings {d} is below the context where acceptance "
                         f"still holds, so it is not where acceptance is lost (SGLang 0.5.23 raises a draft's "
                         f"shorter limit to the target's context when SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1)")
        if tr and tr < t["value"]:
            where.append(f"the draft's training samples average {tr} tokens ({lim['sources'].get('training')}): "
                         f"the fall lies beyond the contexts it was trained on")
        if not where:
            where.append("nothing read here places the fall (settle it with the draft's training sequence length)")
        where.append("cause: workload (prompt + context length), not a wiring or engine fault")
    elif t["sweep"] == "temperature":
        where.append("cause: workload (the requests' sampling temperature): " + (
            sampling_rule or "the engine verifies sampled tokens against the draft's proposals, and fewer match at a "
                             "higher temperature"))
    else:
        where.append("cause: engine: the same prompts accept less when they share a batch (batch-dependent draft or "
                     "verify numerics, padding, or scheduling)")
    return finding(kind, None, head + "; " + "; ".join(where), stage=cause, sweep=t["sweep"], trend=t,
                   limits={k: v for k, v in lim.items() if k != "sources"}, limit_sources=lim.get("sources"),
                   source="data: paired accept-length change over the same prompts (helpers.acceptance.sweeps)")


def _toggle_row(t: Toggle) -> dict:
    return {"name": t.name, "flags": dict(t.flags), "report": t.report, "why": t.why,
            "speculative": t.speculative}


def measure_toggle(t: Toggle, *, restart: dict, client: ServerClient, before, prompts, max_new_tokens: int,
                   run_dir: Path, budget: Budget, api_key: Optional[str] = None, port=None,
                   progress: Callable[[str], None] = lambda s: None, adapter: Optional[EngineAdapter] = None,
                   temperature: float = 0.0) -> dict:
    """Start the server with toggle ``t`` (the engine adapter's restart, its flags), measure it on ``prompts`` and
    compare with ``before`` (the unchanged server's measurement of the same prompts, at ``temperature`` for a
    sampling toggle): ``{"status": "measured", "after", "effect", "recovers", "baseline_faster", ...}``. The variant
    is stopped by its PID before this returns."""
    adapter = adapter or SGLangAdapter()
    row = _toggle_row(t)
    progress(f"toggle {t.name}: starting the server with {flag_text(t.flags) or 'no draft'} ...")
    t0 = time.perf_counter()
    handle = adapter.start_variant(restart, keep_draft=t.speculative, flags=t.flags, api_key=api_key, port=port,
                                   log_path=run_dir / "logs" / f"toggle-{t.name}.log", budget=budget,
                                   capture_dir=run_dir / "capture" / f"toggle-{t.name}",
                                   what=f"the server with {t.name}")
    try:
        with adapter.client(handle.url, api_key, timeout=client.timeout, budget=budget) as c2:
            after = measure(c2, prompts, max_new_tokens=max_new_tokens, label=t.name, progress=False, seed=0,
                            temperature=temperature if t.sampled else 0.0)
    finally:
        handle.stop()
    row["saved_to"] = _save(after, run_dir, "toggles", t.name)
    row.update(status="measured", wall_s=time.perf_counter() - t0,
               before={k: before.summary.get(k) for k in SUMMARY_KEYS},
               after={k: after.summary.get(k) for k in SUMMARY_KEYS})
    if t.speculative:
        e = paired_effect(before.per_request, after.per_request)
        row["effect"] = e
        ref = before.summary.get("accept_length") or float("nan")
        lo, d = e.get("accept_length_delta_lo"), e.get("accept_length_delta")
        row["recovers"] = bool(lo is not None and math.isfinite(lo) and lo > 0
                               and d >= max(MIN_TOKENS, MATERIAL * ref))
        progress(f"toggle {t.name} ({row['wall_s']:.0f} s): accept length {before.summary['accept_length']:.2f} -> "
                 f"{after.summary['accept_length']:.2f}, paired {format_ci(e, 'accept_length_delta', signed=True)}")
    else:
        b, a = before.summary, after.summary
        row["baseline_faster"] = bool(a.get("tok_s_lo") is not None and b.get("tok_s_hi") is not None
                                      and a["tok_s_lo"] > b["tok_s_hi"])
        progress(f"toggle {t.name} ({row['wall_s']:.0f} s): tok/s with the draft {format_ci(b, 'tok_s', digits=1)}, "
                 f"target alone {format_ci(a, 'tok_s', digits=1)}")
    return row


def toggle_finding(row: dict) -> Optional[dict]:
    """``engine_feature_costs_acceptance`` for a toggle that recovers acceptance, ``speculation_slower`` for a
    baseline that is faster than the speculative server (tok/s CIs apart); else None."""
    flags = flag_text(row["flags"])
    if row.get("recovers"):
        e = row["effect"]
        return finding("engine_feature_costs_acceptance", None,
                       f"restarted with {flags}, the server accepts "
                       f"{format_ci(e, 'accept_length_delta', signed=True)} tokens per verify step more over the same "
                       f"prompts: {row['why']} costs acceptance (report: {row['report']})",
                       stage="engine", toggle=row["name"], flags=row["flags"], effect=e,
                       source="measured: the unchanged server and a restarted copy with the flag, paired CI")
    if row.get("baseline_faster"):
        b, a = row["before"], row["after"]
        return finding("speculation_slower", None,
                       f"the target alone is faster than with the draft: {format_ci(a, 'tok_s', digits=1)} tok/s vs "
                       f"{format_ci(b, 'tok_s', digits=1)} per request on the same prompts",
                       stage="engine", toggle=row["name"], before=b, after=a,
                       source="measured: the unchanged server and a restarted copy without the draft")
    return None


def ablate(url: str, *, run_dir: str | Path, sweeps: Sequence[str] = SWEEPS, toggles: Optional[Sequence[str]] = None,
           budget_s: float = 120.0, budget: Optional[Budget] = None, prompts: Any = None, num_prompts: int = 10,
           max_new_tokens: int = 32, temperature: float = 1.0, concurrency: Sequence[int] = (1, 2, 4, 8),
           contexts: Optional[Sequence[int]] = None, relaunch: Optional[str] = None, api_key: Optional[str] = None,
           draft: Optional[str | Path] = None, target: Optional[str | Path] = None,
           training_log: Optional[str | Path] = None, port=None, client: Optional[ServerClient] = None,
           adapter: Optional[EngineAdapter] = None, progress: Callable[[str], None] = lambda s: None) -> dict:
    """Run the sweeps, then the toggles, within ``budget_s`` seconds; write ``results/ablate.json`` into ``run_dir``.

    Args:
        url: the server (``/server_info``, ``/generate``, ``/flush_cache``).
        sweeps: a subset of :data:`helpers.acceptance.sweeps.SWEEPS`, in order.
        toggles: names of the server's engine toggles (``adapter.toggles()``: SGLang's
            :data:`helpers.acceptance.ablations.TOGGLES`, vLLM's ``helpers.engines.vllm.TOGGLES``); None: every toggle
            when the server can be restarted (an embedded server of the registry, or ``relaunch``), none otherwise
            (listed as skipped); ``()``: none.
        adapter: the server's engine adapter (default: detected from ``url``); client: its client.
        temperature: the user's temperature, measured against 0 (the temperature sweep).
        prompts / num_prompts: the prompt set (default: the bundled prompts), the same ids at every point.
        max_new_tokens: tokens generated per request at every point.
        relaunch: the server's launch command (shell words) when it is not an embedded server of this tool.
        draft / target / training_log: folders / file read for the context limits (default: the server's own
            folders when this machine sees them; the training log found next to the draft).

    Returns: the document written to ``results/ablate.json``: ``{"format", "version", "url", "sglang_version",
    "device", "limits", "prompts", "max_new_tokens", "sweeps": {name: {"points": [...], "trend"}}, "toggles":
    [...], "findings": [...], "skipped": [...], "failed_requests": [...], "wall_s", "budget_s"}``
    (``failed_requests``: one line per point or toggle with failed requests, kept with ``n_failed``). A point or toggle
    the budget cannot fit is skipped with the reason; what was measured is kept. A run cut short by a signal or a
    server failure writes what it measured, with ``"stopped"`` (the reason) and what it did not run under
    ``skipped``, then raises; every point is saved under ``ablate/`` as soon as it is measured.

    Raises:
        BadInput: an unknown sweep or toggle, bad numbers, a ``relaunch`` that is not a command line
            (:func:`helpers.server.restart.relaunch_argv`), a run folder that holds ablation results already
            (checked before any request: nothing is overwritten). ServerError: the server cannot be reached.
    """
    run_dir = Path(run_dir)
    _check_args(run_dir, sweeps, toggles, num_prompts, max_new_tokens, _all_toggles())
    argv = relaunch_argv(relaunch) if relaunch else None
    ps = load_prompts(prompts, n=num_prompts)       # a bad prompt file is bad input before any request
    dl = budget or Budget(budget_s, flag="--budget")
    adapter = adapter or detect(url, api_key, budget=dl).adapter      # detection spends the one budget too
    chosen = _check_args(run_dir, sweeps, toggles, num_prompts, max_new_tokens, adapter.toggles())
    own = client is None
    a = _Ablation(run_dir=run_dir, dl=dl, client=client or adapter.client(url, api_key, budget=dl),
                  progress=progress, t_start=time.perf_counter(), adapter=adapter)
    try:
        info = a.info = a.client.server_info(refresh=True)
        if not info.get("speculative_algorithm"):
            raise BadInput("the server runs without speculative decoding: there is no acceptance to sweep",
                           field="--url")
        readable = lambda p: Path(p) if p and Path(p).is_dir() else None  # noqa: E731
        draft_dir = readable(draft) or readable(info.get("speculative_draft_model_path"))
        target_dir = readable(target) or readable(info.get("model_path"))
        log = find_training_log(draft_dir, training_log) if draft_dir is not None else None
        a.lim = limits(info, draft_dir=draft_dir, target_dir=target_dir, training_log=log)
        a.ps = ps
        a.doc = {"format": FORMAT, "version": 1, "url": a.client.url, "engine": adapter.name,
                 "engine_version": info.get("version"), "sglang_version": info.get("sglang_version", info.get("version")),
                 "device": info.get("device"), "limits": a.lim, "prompts": len(a.ps), "max_new_tokens": max_new_tokens,
                 "temperature": temperature, "sweeps": {}, "toggles": [], "findings": [], "skipped": [],
                 "failed_requests": [], "budget_s": budget_s}
        a.todo = [f"sweep {s}" for s in sweeps] + [f"toggle {t.name}" for t in chosen]
        for s in sweeps:
            _sweep(a, s, max_new_tokens=max_new_tokens, temperature=temperature, concurrency=concurrency,
                   contexts=contexts)
        # toggles: on restarted copies of the server
        entry = lookup(a.client.url)
        restart = ({"kind": "embedded", **entry} if entry is not None
                   else {"kind": "command", "argv": argv} if argv else None)
        if toggles is None:
            chosen = list(adapter.toggles()) if restart is not None else []
            if restart is None:
                a.doc["skipped"].append("toggles: this server cannot be restarted by the tool (pass --relaunch CMD, "
                                        "or start it with `python -m helpers server start`)")
        _toggles(a, chosen, info, restart, max_new_tokens=max_new_tokens, api_key=api_key, port=port,
                 temperature=temperature)
        a.doc["skipped"] += [f"toggle {r['name']}: {r['reason']}" for r in a.doc["toggles"]
                             if r["status"] != "measured"]
        a.doc["wall_s"] = time.perf_counter() - a.t_start
        write_json(run_dir / "results" / "ablate.json", a.doc)
        return a.doc
    except BaseException as exc:
        if a.doc is not None and not (run_dir / "results" / "ablate.json").exists():
            _write_cut_short(a.doc, run_dir, exc, a.running, a.todo, time.perf_counter() - a.t_start)
        raise
    finally:
        if own:
            a.client.close()


@dataclass
class _Ablation:
    """The state an ablation run fills: the document, the prompts and limits, the reference measurement (the
    unchanged server on these prompts), and for a run cut short what has not started and what runs now."""

    run_dir: Path
    dl: Budget
    client: ServerClient
    progress: Callable[[str], None]
    t_start: float
    adapter: EngineAdapter = field(default_factory=lambda: SGLangAdapter())
    doc: Optional[dict] = None
    lim: Optional[dict] = None
    ps: Any = None
    reference: Any = None
    todo: list = field(default_factory=list)
    running: list = field(default_factory=list)
    references: dict = field(default_factory=dict)
    info: dict = field(default_factory=dict)


def _all_toggles() -> tuple[Toggle, ...]:
    """Every engine's toggles (a name no engine knows is bad input before any request)."""
    return tuple(t for name in sorted(BY_ENGINE) for t in adapter_named(name).toggles())


def _check_args(run_dir: Path, sweeps: Sequence[str], toggles: Optional[Sequence[str]], num_prompts: int,
                max_new_tokens: int, known: Sequence[Toggle]) -> list:
    """Bad arguments are bad input (before any request when ``known`` is every engine's toggles); returns the named
    toggles of ``known``."""
    if (run_dir / "results" / "ablate.json").exists():
        raise BadInput("the run folder already holds ablation results (results/ablate.json); ablate into a new run "
                       "folder", path=run_dir)
    for s in sweeps:
        if s not in SWEEPS:
            raise BadInput(f"unknown sweep {s!r}; expected a comma-separated subset of {','.join(SWEEPS)}",
                           field="--sweeps")
    table = {t.name: t for t in known}
    unknown = [n for n in (toggles or []) if n not in table]
    if unknown:
        raise BadInput(f"unknown toggle {unknown[0]!r}; known: {', '.join(table)}", field="--toggles")
    chosen = [table[n] for n in (toggles or [])]
    if num_prompts < 2:
        raise BadInput(f"need at least 2 prompts for a paired CI, got {num_prompts}", field="--num-prompts")
    if max_new_tokens < 2:
        raise BadInput(f"max_new_tokens must be >= 2 (a verify step needs two tokens), got {max_new_tokens}",
                       field="--max-new-tokens")
    return chosen


def _sweep(a: _Ablation, s: str, *, max_new_tokens: int, temperature: float, concurrency: Sequence[int],
           contexts: Optional[Sequence[int]]) -> None:
    """One workload sweep, each point saved as measured; its trend and finding."""
    doc, progress = a.doc, a.progress
    a.todo.remove(f"sweep {s}")
    a.running[:] = [f"sweep {s}"]
    if a.dl.spent():
        doc["skipped"].append(f"sweep {s}: budget spent")
        progress(f"sweep {s}: skipped (budget spent)")
        return
    progress(f"sweep {s} ...")
    pts: list[Point] = []
    doc["sweeps"][s] = {"points": [], "trend": None}

    def keep(p: Point) -> None:                       # saved at once: a run cut short keeps it
        if p.result is not None:
            p.summary["saved_to"] = _save(p.result, a.run_dir, s, p.label)
        pts.append(p)
        doc["sweeps"][s]["points"].append(p.to_json())
    run_sweep(a.client, s, prompts=a.ps, max_new_tokens=max_new_tokens, budget=a.dl, limits=a.lim,
              temperatures=(0.0, temperature), concurrency=concurrency, contexts=contexts, progress=progress,
              on_point=keep)
    if a.reference is None and pts and pts[0].result is not None:
        a.reference = pts[0].result           # the unchanged server on these prompts (first reference point)
        a.references.setdefault("greedy", a.reference)
    t = trend(pts, a.lim)
    doc["sweeps"][s] = {"points": [p.to_json() for p in pts], "trend": t}
    doc["skipped"] += [f"sweep {s}: {p.label}: {p.skipped}" for p in pts if p.skipped]
    doc["failed_requests"] += [_failed(f"sweep {s}: {p.label}", p.result) for p in pts
                               if p.result is not None and p.result.summary.get("n_failed")]
    if t is not None:
        doc["findings"].append(sweep_finding(t, a.lim, a.adapter.sampling_rule(a.info)))
    a.running.clear()


def _toggles(a: _Ablation, chosen: list, info: dict, restart: Optional[dict], *, max_new_tokens: int,
             api_key: Optional[str], port, temperature: float = 1.0) -> None:
    """The engine toggles, each on a restarted copy, paired with the unchanged server; skipped with a reason when
    it does not apply or the budget cannot fit a restart and a measurement."""
    doc, progress, dl = a.doc, a.progress, a.dl
    toggle_cost, measured_toggles = FIRST_TOGGLE_S, 0
    a.todo = [f"toggle {t.name}" for t in chosen]
    for t in chosen:
        a.todo.remove(f"toggle {t.name}")
        row = _toggle_row(t)
        why = t.skip_reason(info)
        if why is None and restart is None:
            why = "this server cannot be restarted by the tool (pass --relaunch CMD)"
        left = dl.remaining()
        if why is None and left is not None and left < toggle_cost:
            why = (f"budget: {max(0.0, left):.0f} s left, a restart and its measurement take ~{toggle_cost:.0f} s"
                   + ("" if measured_toggles else " (the first toggle's estimate)"))
        if why is not None:
            row.update(status="skipped", reason=why)
            doc["toggles"].append(row)
            progress(f"toggle {t.name}: skipped ({why})")
            continue
        key = "sampled" if t.sampled else "greedy"
        if a.references.get(key) is None:
            progress(f"measuring the unchanged server for the toggles ({key}) ...")
            a.references[key] = measure(a.client, a.ps, max_new_tokens=max_new_tokens, label=f"unchanged ({key})",
                                        progress=False, seed=0, temperature=temperature if t.sampled else 0.0)
            if a.references[key].summary.get("n_failed"):
                doc["failed_requests"].append(_failed("the unchanged server (toggles' reference)", a.references[key]))
        if a.reference is None and not t.sampled:
            a.reference = a.references[key]
        a.running[:] = [f"toggle {t.name}"]
        try:
            row = measure_toggle(t, restart=restart, client=a.client, before=a.references[key], prompts=a.ps,
                                 max_new_tokens=max_new_tokens, run_dir=a.run_dir, budget=dl, api_key=api_key,
                                 port=port, progress=progress, adapter=a.adapter, temperature=temperature)
            if (row.get("after") or {}).get("n_failed"):
                doc["failed_requests"].append(f"toggle {t.name}: {row['after']['n_failed']} of "
                                              f"{row['after']['n_failed'] + (row['after']['n_requests'] or 0)} "
                                              f"requests failed (kept in {row.get('saved_to')})")
        except ServerError as exc:
            row.update(status="failed" if not dl.spent() else "skipped",
                       reason=("budget spent while it ran: " if dl.spent() else "") + str(exc).splitlines()[0])
            progress(f"toggle {t.name}: {row['status']} ({row['reason']})")
        a.running.clear()
        doc["toggles"].append(row)
        if row.get("status") == "measured":
            measured_toggles += 1
            toggle_cost = max(toggle_cost if measured_toggles > 1 else 0.0, row["wall_s"])
        f = toggle_finding(row) if row.get("status") == "measured" else None
        if f is not None:
            doc["findings"].append(f)


def _failed(where: str, res) -> str:
    s = res.summary
    n = int(s.get("n_failed") or 0)
    first = res.per_request["error"].dropna()
    why = f"; first error: {str(first.iloc[0]).splitlines()[0][:300]}" if len(first) else ""
    return f"{where}: {n} of {n + int(s.get('n_requests') or 0)} requests failed{why}"


def _write_cut_short(doc: dict, run_dir: Path, exc: BaseException, running: Sequence[str], todo: Sequence[str],
                     wall_s: float) -> None:
    """``results/ablate.json`` of a run cut short by ``exc`` (a signal, a server failure): what was measured, the
    reason under ``stopped``, the sweep or toggle that was running and each one that did not start under
    ``skipped``. A write that fails (a full disk) is left to the error already on its way."""
    reason = describe(exc)
    doc["stopped"] = reason
    for w in running:
        n = len((doc["sweeps"].get(w.split(" ", 1)[1]) or {}).get("points") or []) if w.startswith("sweep ") else 0
        doc["skipped"].append(f"{w}: cut short" + (f" after {n} point(s)" if n else "") + f" ({reason})")
    doc["skipped"] += [f"{w}: not run ({reason})" for w in todo]
    doc["wall_s"] = wall_s
    try:
        write_json(run_dir / "results" / "ablate.json", doc)
    except OSError:
        pass


def ablation_text(doc: dict) -> str:
    """One paragraph: what each sweep and toggle showed, and what was skipped."""
    parts = []
    for s, sw in (doc.get("sweeps") or {}).items():
        n = sum(1 for p in sw["points"] if not p.get("skipped"))
        parts.append(f"{s}: {n} point(s), " + ("acceptance falls" if sw.get("trend") else "no CI-supported fall"))
    for r in doc.get("toggles") or []:
        if r["status"] == "measured" and r.get("effect"):
            e = r["effect"]
            parts.append(f"{r['name']}: {format_ci(e, 'accept_length_delta', signed=True)}")
        elif r["status"] == "measured":
            parts.append(f"{r['name']}: tok/s {r['before']['tok_s']:.1f} with the draft, {r['after']['tok_s']:.1f} "
                         f"without")
    return "; ".join(parts) or "nothing measured"
