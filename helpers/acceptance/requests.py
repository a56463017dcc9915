"""Sending the measurement's ``/generate`` requests (non-streaming, so the final chunk carries the spec
fields) and one per-request record each.
"""
from __future__ import annotations

import json
import queue
import threading
import time
from typing import Any, Callable, Mapping, Optional, Sequence

import pandas as pd
from tqdm.auto import tqdm

from ..errors import BadInput, SGLangError
from ..server.client import ServerClient
from ..server.protocol import GenerateResult
from .prompts import Prompt
from .stats import accepted_drafts

PER_REQUEST_COLUMNS = [
    "idx", "prompt_id", "kind", "prompt_tokens", "completion_tokens", "cached_tokens", "verify_ct",
    "correct_drafts", "proposed_drafts", "hist_correct_drafts", "histogram", "accept_length",
    "accept_rate", "server_accept_length", "latency_s", "e2e_latency_s", "tok_s", "finish_reason",
    "has_spec", "error"]


def record(i: int, p: Prompt, res: Optional[GenerateResult], error: Optional[str]) -> dict:
    """One row of :data:`PER_REQUEST_COLUMNS` from one ``/generate`` answer (or its error)."""
    row = {c: None for c in PER_REQUEST_COLUMNS}
    row.update(idx=i, prompt_id=p.id, kind=p.kind, has_spec=False, error=error)
    if res is None:
        return row
    m = res.meta_info
    hist = list(m.spec_correct_drafts_histogram) if m.spec_correct_drafts_histogram else None
    ct = m.completion_tokens if m.completion_tokens is not None else len(res.output_ids)
    fr = m.finish_reason
    row.update(
        prompt_tokens=m.prompt_tokens, completion_tokens=ct, cached_tokens=m.cached_tokens,
        verify_ct=m.spec_verify_ct, correct_drafts=m.spec_num_correct_drafts,
        proposed_drafts=m.spec_num_proposed_drafts,
        hist_correct_drafts=accepted_drafts(hist) if hist else None,
        histogram=json.dumps(hist) if hist is not None else None,
        accept_length=(ct / m.spec_verify_ct) if m.spec_verify_ct else None,
        accept_rate=(m.spec_num_correct_drafts / m.spec_num_proposed_drafts
                     if m.spec_num_proposed_drafts else None),
        server_accept_length=m.spec_accept_length, latency_s=res.latency_s,
        e2e_latency_s=m.e2e_latency, tok_s=(ct / res.latency_s) if res.latency_s > 0 else None,
        finish_reason=(fr.get("type") if isinstance(fr, Mapping) else fr), has_spec=m.has_spec_fields)
    return row


def run_requests(client: ServerClient, prompts: Sequence[Prompt], *, max_new_tokens: int,
                 concurrency: int = 1, sampling_params: Optional[Mapping[str, Any]] = None,
                 return_hidden_states: bool = False, progress: bool | str = True,
                 keep_raw: bool = False, fail_fast: bool = False,
                 per_request_sampling: Optional[Sequence[Mapping[str, Any]]] = None
                 ) -> tuple[pd.DataFrame, float, list[Optional[dict]]]:
    """Send every prompt once (``concurrency`` threads, one shared client); collect meta_info.

    ``per_request_sampling[i]`` (SGLang-named sampling params, e.g. a requests file's own,
    :mod:`helpers.acceptance.workload`) is laid over ``sampling_params`` and ``max_new_tokens`` for prompt ``i``.

    Returns ``(per_request DataFrame [PER_REQUEST_COLUMNS], wall seconds, raw)``; ``raw[i]`` is
    the answer's ``meta_info`` dict (hidden states dropped) when ``keep_raw``, else None. A failed
    request gets its ``error`` column set (or raises when ``fail_fast``).
    """

    if concurrency < 1:
        raise BadInput(f"concurrency must be >= 1, got {concurrency}", field="--concurrency")
    sp = dict(sampling_params or {})
    sp["max_new_tokens"] = int(max_new_tokens)
    if per_request_sampling is not None and len(per_request_sampling) != len(prompts):
        raise ValueError(f"per_request_sampling has {len(per_request_sampling)} entries for {len(prompts)} prompts")
    rows: list[Optional[dict]] = [None] * len(prompts)
    raw: list[Optional[dict]] = [None] * len(prompts)

    def one(i: int) -> None:
        p = prompts[i]
        try:
            res = client.generate(**p.request(), sampling_params=(
                                      sp if per_request_sampling is None else {**sp, **per_request_sampling[i]}),
                                  return_hidden_states=return_hidden_states)
        except SGLangError as exc:
            if fail_fast:
                raise
            rows[i] = record(i, p, None, str(exc))
            return
        rows[i] = record(i, p, res, None)
        if keep_raw:
            meta = res.meta_info.model_dump()
            meta.pop("hidden_states", None)
            raw[i] = {"output_ids": list(res.output_ids), "meta_info": meta}

    desc = progress if isinstance(progress, str) else "requests"
    bar = tqdm(total=len(prompts), desc=desc, disable=not progress, leave=False)
    t0 = time.perf_counter()
    try:
        _in_workers(one, len(prompts), concurrency, on_done=lambda: bar.update(1))
    except KeyboardInterrupt:   # Ctrl-C or a signal (helpers.cli.common.Interrupted): the requests in flight end too
        client.budget.cancel("interrupted")
        raise
    finally:
        bar.close()
    wall = time.perf_counter() - t0
    df = pd.DataFrame(rows, columns=PER_REQUEST_COLUMNS)
    return df, wall, raw


def _in_workers(fn: Callable[[int], None], n: int, workers: int, on_done: Callable[[], None]) -> None:
    """``fn(i)`` for ``i`` in ``range(n)`` on ``workers`` daemon threads; returns when all are done, re-raises the
    first exception of a worker. Daemon threads, not a ``ThreadPoolExecutor``: when the main thread is
    interrupted (Ctrl-C, SIGTERM), it returns at once, and the process exits without joining a worker still
    blocked in a read (an executor joins its threads on the way out and at interpreter exit: a trickling server
    then holds the command until its deadline)."""
    items = iter(range(n))
    lock = threading.Lock()
    done: "queue.SimpleQueue[Optional[BaseException]]" = queue.SimpleQueue()
    stop = threading.Event()

    def work() -> None:
        while not stop.is_set():
            with lock:
                i = next(items, None)
            if i is None:
                return
            try:
                fn(i)
            except BaseException as exc:  # noqa: BLE001 - handed to the main thread
                done.put(exc)
                return
            done.put(None)

    for k in range(min(workers, n)):
        threading.Thread(target=work, daemon=True, name=f"e3f-request-{k}").start()
    try:
        for _ in range(n):
            exc = done.get()
            if exc is not None:
                raise exc
            on_done()
    finally:
        stop.set()


#: the counters two answers to one greedy request are compared on (besides the tokens)
REPEAT_FIELDS = ("spec_verify_ct", "spec_num_correct_drafts", "completion_tokens")


def repeatability(client: ServerClient, prompt: Prompt, *, max_new_tokens: int, times: int = 2) -> dict:
    """Whether the server answers one greedy request (``temperature 0``, ``ignore_eos``, the prefix cache emptied
    before each) the same ``times`` times: the condition for the same investigation to reach the same verdict twice
    on this server. The tool's own computation is deterministic (seeded bootstraps in a canonical order, stable
    orders, :mod:`helpers.draft` on one thread for small drafts); what it cannot make equal is a server whose greedy
    tokens or speculative counters move between calls (batch-dependent kernels, a draft with sampling on, other
    clients' requests batched beside ours), and a verdict resting on a decision near its threshold may then flip.

    Returns: ``{"prompt", "same" (bool), "answers" ([{"tokens": first differing index or None, fields...}]),
    "note" (None when the answers agree, else one sentence naming the prompt, the first token that differs and the
    counters)}``.

    Raises: what ``client.generate`` / ``flush_cache`` raise (:class:`helpers.errors.ServerError`)."""
    sp = {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": int(max_new_tokens)}
    answers = []
    for _ in range(max(2, times)):
        client.flush_cache()
        res = client.generate(**prompt.request(), sampling_params=sp)
        m = res.meta_info
        answers.append({"output_ids": list(res.output_ids), **{f: getattr(m, f, None) for f in REPEAT_FIELDS}})
    first = answers[0]
    diffs = []
    for k, a in enumerate(answers[1:], 2):
        at = next((j for j, (x, y) in enumerate(zip(first["output_ids"], a["output_ids"])) if x != y),
                  None if len(first["output_ids"]) == len(a["output_ids"]) else
                  min(len(first["output_ids"]), len(a["output_ids"])))
        fields = [f"{f} {first[f]} vs {a[f]}" for f in REPEAT_FIELDS if first[f] != a[f]]
        if at is not None or fields:
            diffs.append((k, at, fields))
    note = None
    if diffs:
        k, at, fields = diffs[0]
        what = ([f"the greedy tokens differ from output position {at}"] if at is not None else []) + fields
        note = (f"the server answered one greedy request (prompt {prompt.id}, the cache emptied before each) "
                f"differently on call {k} than on call 1 ({'; '.join(what)}): its acceptance moves between calls, so "
                "a measurement, and a decision near its threshold, can differ from one run of the same investigation "
                "to the next (the tool's own computation gives the same result on the same answers)")
    return {"prompt": prompt.id, "same": not diffs,
            "answers": [{k: v for k, v in a.items() if k != "output_ids"} | {"n_tokens": len(a["output_ids"])}
                        for a in answers], "note": note}
