"""``python -m helpers ablate``: workload sweeps (context length, temperature, requests in flight) on the running
server and engine toggles (radix cache, chunked prefill, overlap scheduler, CUDA graphs, attention / sampling backend,
spec v1, the draft itself) on restarted copies, each with a paired CI over the same prompts
(helpers.investigation.ablate).

Exit 0 nothing loses acceptance, 1 a sweep or toggle shows a loss (a finding), requests failed (the measurements
are kept with ``n_failed``) or a restarted copy failed (one line says where), 2 bad input."""
from __future__ import annotations

import json
import os
from typing import Optional, Sequence

from ..acceptance.measure import check_settings
from ..acceptance.prompts import load_prompts
from ..engines.detect import ADAPTERS

#: every engine's toggle names (the server's engine decides which apply: ``EngineAdapter.toggles``)
BY_NAME = list(dict.fromkeys(t.name for a in ADAPTERS for t in a().toggles()))
from ..acceptance.sweeps import SWEEPS
from ..errors import BadInput, RunFailed
from ..investigation.ablate import ablate, ablation_text
from ..server.client import check_url
from ..server.embedded import parse_ports
from ..server.restart import relaunch_argv
from ..redaction import url_label
from ..runfiles import new_run_dir, safe_name
from ..views.common import run_dir_line
from .common import Parser, failure_guard, out_folder, progress_line, run, subset_arg


def build_parser() -> Parser:
    p = Parser(prog="python -m helpers ablate",
               description="Measure what the workload and the engine cost in acceptance: accept length / rate / "
                           "per-position acceptance / tok/s against context length, temperature and requests in "
                           "flight on the running server, then with one engine feature turned off at a time on a "
                           "restarted copy, each against the unchanged server over the same prompts (paired CI).")
    p.add_argument("--url", required=True, help="the server's base URL, e.g. http://127.0.0.1:30000")
    p.add_argument("--sweeps", default=",".join(SWEEPS), help=f"comma-separated subset of {','.join(SWEEPS)}, or "
                   "none (default: all, in that order)")
    p.add_argument("--toggles", help=f"comma-separated subset of {','.join(BY_NAME)}, or none (default: every toggle "
                   "when the server can be restarted; one that does not apply to its version or device is skipped "
                   "with the reason)")
    p.add_argument("--budget", type=float, default=120.0, help="overall time budget in seconds (default 120); what "
                   "does not fit is skipped and listed")
    p.add_argument("--prompts", help="prompt file (.jsonl / .json; default: the bundled prompts)")
    p.add_argument("--num-prompts", type=int, default=10, help="prompts per point (default 10)")
    p.add_argument("--max-new-tokens", type=int, default=32, help="tokens generated per request (default 32)")
    p.add_argument("--temperature", type=float, default=1.0, help="your requests' temperature, measured against 0 "
                   "(default 1.0)")
    p.add_argument("--concurrency", default="1,2,4,8", help="requests in flight to measure (default 1,2,4,8)")
    p.add_argument("--contexts", help="context lengths in tokens (prompt + generated) to measure (default: points "
                   "around the draft's limit and up to the target's)")
    p.add_argument("--relaunch", metavar="CMD", help="the server's launch command (one string), for the toggles; "
                   "servers started with `python -m helpers server start` are restarted without it")
    p.add_argument("--draft", help="the draft folder, when the server's is not readable here (its config's "
                   "max_position_embeddings)")
    p.add_argument("--target", help="the target folder, when the server's is not readable here")
    p.add_argument("--training-log", help="the draft's training log (default: looked for in the draft folder)")
    p.add_argument("--port", metavar="PORT|LOW-HIGH", help="port (or range) of the restarted copies")
    p.add_argument("--out", help="folder under which the run folder is created (default outputs/)")
    p.add_argument("--api-key-env", default="SGLANG_API_KEY", help="NAME of the environment variable holding the "
                   "server's API key (default SGLANG_API_KEY; the key is never written)")
    p.add_argument("--json", action="store_true", help="print the results document (results/ablate.json)")
    return p


#: the largest context (tokens) and requests in flight a sweep takes: beyond any server's (a 10M-token context is the
#: longest public one), and a prompt of that many tokens is built here before it is sent
MAX_CONTEXT, MAX_CONCURRENCY = 1 << 24, 4096


def _ints(value: Optional[str], flag: str, most: int) -> Optional[list[int]]:
    if value is None:
        return None
    try:
        out = [int(x) for x in value.split(",") if x.strip()]
    except ValueError:
        raise BadInput(f"expected comma-separated integers, got {value!r}", field=flag) from None
    if not out or min(out) < 1 or max(out) > most:
        raise BadInput(f"expected integers from 1 to {most}, got {value!r}", field=flag)
    return list(dict.fromkeys(out))


def cli_main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m helpers ablate ...`` (module docstring)."""
    prog = "ablate"

    def body() -> int:
        a = build_parser().parse_args(list(argv) if argv is not None else None)
        check_url(a.url)                           # before the run folder is made
        sweeps = subset_arg(a.sweeps, SWEEPS, "--sweeps") or []
        toggles = subset_arg(a.toggles, BY_NAME, "--toggles")
        conc, ctx = _ints(a.concurrency, "--concurrency", MAX_CONCURRENCY), _ints(a.contexts, "--contexts", MAX_CONTEXT)
        if a.relaunch is not None:
            relaunch_argv(a.relaunch)
        if not a.budget > 0:
            raise BadInput(f"must be > 0 seconds, got {a.budget}", field="--budget")
        check_settings(temperature=a.temperature)
        parse_ports(a.port, what="--port")
        # a bad prompt file is bad input before the run folder is made (fewer than 2 prompts: ablate's own message)
        prompts = load_prompts(a.prompts, n=a.num_prompts) if a.num_prompts >= 2 else a.prompts
        out = out_folder(a.out, "--out")
        show = progress_line(prog)
        run_dir = new_run_dir("ablate-" + safe_name(url_label(a.url)), out)      # no credentials in a folder name
        show(f"run folder {run_dir}")
        show(f"to open it in the notebooks, paste into their parameters cell: {run_dir_line(run_dir)}")
        with failure_guard(prog, run_dir):
            doc = ablate(a.url, run_dir=run_dir, sweeps=sweeps, toggles=toggles, budget_s=a.budget,
                         prompts=prompts, num_prompts=a.num_prompts, max_new_tokens=a.max_new_tokens,
                         temperature=a.temperature, concurrency=conc or (1, 2, 4, 8), contexts=ctx,
                         relaunch=a.relaunch, api_key=os.environ.get(a.api_key_env) or None, draft=a.draft,
                         target=a.target, training_log=a.training_log, port=a.port, progress=show)
        failed = doc["failed_requests"] + [f"toggle {r['name']} failed: {r['reason']}" for r in doc["toggles"]
                                           if r["status"] == "failed"]
        measured = any(not p.get("skipped") for sw in doc["sweeps"].values() for p in sw["points"]) or \
            any(r["status"] == "measured" for r in doc["toggles"])
        if not measured and not failed and (sweeps or any(r["status"] != "skipped" or "budget" in r.get("reason", "")
                                                  for r in doc["toggles"])):
            failed.append(f"nothing was measured within the budget of {a.budget:g} s (the server did not answer in "
                          f"time, or raise --budget)")
        if a.json:
            print(json.dumps(doc, indent=1))
        else:
            print(ablation_text(doc))
            for f in doc["findings"]:
                print(f"{f['kind']}: {f['detail']}")
            for s in doc["skipped"]:
                print(f"skipped: {s}")
            if not doc["findings"] and measured:
                print("No sweep or toggle shows a CI-supported loss of acceptance.")
            print(f"results: {run_dir / 'results' / 'ablate.json'} ({doc['wall_s']:.0f} s of {a.budget:.0f} s)")
        if failed:
            raise RunFailed("; ".join(failed) + f" (what was measured is kept in {run_dir})")
        return 1 if doc["findings"] else 0

    return run(prog, body)
