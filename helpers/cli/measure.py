"""``python -m helpers measure``: measure one server, or run a fixes file (managed mode).

Exit codes (:mod:`helpers.cli.common`): 0 measured with every request answered; 1 the server failed, a request
failed (the measurement is still saved, with ``n_failed``), or a fix could not be measured; 2 bad input (a run
folder whose ledger cannot be read: the new measurement is kept, and the message gives the command that rebuilds the
ledger, ``measure --rebuild-ledger RUN_DIR``: 0 rebuilt, 1 a measurement folder could not be read and was left
out). With ``--requests FILE`` (docs/workload.md) both request sets are measured and saved; a ``requests_accept_less``
finding is printed and written to ``workload.json``, and the exit code stays 0 when every request was answered."""
from __future__ import annotations

import json
import os
import sys
from typing import Sequence

from ..acceptance.fixes import FixFailed, load_fixes, run_fixes
from ..acceptance.ledger import Ledger
from ..acceptance.measure import (
    SUMMARY_COLUMNS,
    _json_default,
    failed_requests,
    format_summary,
    measure,
    rebuild_ledger,
)
from ..acceptance.prompts import load_prompts
from ..budget import Budget
from ..errors import BadInput, RunFailed, printable
from ..runfiles import atomic_write_text, new_run_dir
from ..server.client import check_url
from ..engines.detect import detect_or
from .common import Parser, failure_guard, input_path_arg, out_folder, progress_line, run, run_folder_arg, text_arg

DEFAULT_TIMEOUT = 3600.0


def build_parser() -> Parser:
    ap = Parser(prog="python -m helpers measure",
                description="Accept length / accept rate / per-position acceptance / tok/s with 95% CIs. "
                            "Attach to a server (--url) or run a fixes file (--fixes). The API key is read "
                            "from $SGLANG_API_KEY (never from the command line).")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--url", help="server URL, e.g. http://127.0.0.1:30000")
    src.add_argument("--fixes", help="fixes YAML file (managed mode: a server per fix)")
    src.add_argument("--rebuild-ledger", metavar="RUN_DIR",
                     help="rebuild RUN_DIR/ledger.parquet from its measurement folders (fixes/, acceptance/), keeping "
                          "the old file beside it (ledger.parquet.corrupt-<stamp>); measures nothing")
    ap.add_argument("--label", default=None, help="fix name for this measurement (a repeated label gets its own "
                                                  "folder: fixes/<label>-2, ...)")
    ap.add_argument("--prompts", default=None, help="prompt file (.jsonl/.json); default: bundled set")
    ap.add_argument("--requests", default=None, metavar="FILE",
                    help="your workload: JSONL of OpenAI chat / completions bodies or SGLang /generate bodies, each "
                         "replayed with its own sampling params (chat bodies through the target tokenizer's chat "
                         "template); the bundled training-like prompts are measured on the same server and a "
                         "requests_accept_less finding says whether yours accept materially less (docs/workload.md)")
    ap.add_argument("--tokenizer", default=None, metavar="DIR",
                    help="the target's tokenizer folder, for the chat template (default: the server's "
                         "tokenizer_path / model_path when readable here)")
    ap.add_argument("--training", default=None, metavar="DIR",
                    help="the draft's training data: when its samples were chat-formatted with the tokenizer's "
                         "template, the bundled prompts are sent through that template (default: as they are)")
    ap.add_argument("--num-prompts", type=int, default=None)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--ignore-eos", action="store_true")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--no-flush", action="store_true", help="do not flush the cache first")
    ap.add_argument("--bootstrap", type=int, default=2000, help="bootstrap resamples")
    ap.add_argument("--baseline-url", default=None, help="server without the draft, for baseline tok/s")
    ap.add_argument("--requested", default=None,
                    help="launch command as typed, for the override check (default: the server's own)")
    ap.add_argument("--outputs", default=None, help="outputs folder (default: <repo>/outputs)")
    ap.add_argument("--run-dir", default=None, help="an existing run folder to append to (ledger.parquet)")
    ap.add_argument("--timeout", type=float, default=None,
                    help=f"overall budget in seconds of the whole run: every request, and with --fixes every server "
                         f"start too (default {DEFAULT_TIMEOUT:.0f} with --url; none with --fixes, where each fix's "
                         "startup_timeout and the request timeouts bound the waits)")
    ap.add_argument("--no-save", action="store_true", help="print only, write nothing")
    ap.add_argument("--json", action="store_true", help="print the summary as JSON")
    ap.add_argument("--quiet", action="store_true", help="no progress bars")
    return ap


def cli_main(argv: Sequence[str]) -> int:
    """``python -m helpers measure ...`` (module docstring)."""

    def body() -> int:
        args = build_parser().parse_args(list(argv))
        for flag, url in (("--url", args.url), ("--baseline-url", args.baseline_url)):
            if url is not None:
                check_url(url, flag)               # before any folder or request
        if args.rebuild_ledger is not None:
            return _rebuild(run_folder_arg(args.rebuild_ledger, "--rebuild-ledger"))
        outputs = out_folder(args.outputs, "--outputs")
        given_run = run_folder_arg(args.run_dir)
        text_arg(args.label, "--label")
        if args.timeout is not None and not args.timeout > 0:
            raise BadInput(f"--timeout must be > 0 seconds, got {args.timeout}")
        if args.fixes:
            fixes = load_fixes(args.fixes)
            run_dir = given_run or new_run_dir(fixes.name, outputs=outputs)
            with failure_guard("measure", run_dir, owned=given_run is None, complete=(FixFailed,)):
                run_fixes(fixes, run_dir=run_dir, progress=not args.quiet, budget=Budget(args.timeout))
                df = Ledger(run_dir / "ledger.parquet").read()
            cols = [c for c in SUMMARY_COLUMNS if c in df.columns]
            print(df[["fix"] + [c for c in cols if c != "label"]].to_string(index=False))
            print(f"run folder: {run_dir}")
            return 0
        if args.requests and args.prompts:
            raise BadInput("give --requests (your workload) or --prompts, not both")
        input_path_arg(args.training, "--training")
        input_path_arg(args.tokenizer, "--tokenizer")
        prompts = None if args.requests else load_prompts(args.prompts, n=args.num_prompts)
        if args.requests:                          # every line checked before any request (chat rendered later)
            from ..acceptance.workload import CHECK_ONLY, load_requests  # lazy: only with --requests
            load_requests(args.requests, tokenizer=CHECK_ONLY)
        key = os.environ.get("SGLANG_API_KEY") or None
        budget = Budget(args.timeout or DEFAULT_TIMEOUT)   # the command's one deadline: detection, then requests
        show = progress_line("measure")
        adapter = detect_or(args.url, key, budget=budget, on_wait=show)    # the engine, once
        client = adapter.client(args.url, key, budget=budget, on_wait=show)
        if args.requests or args.training:
            try:
                return _workload(args, client, adapter, prompts, outputs, given_run, show)
            finally:
                client.close()
        try:
            res = measure(client, prompts, max_new_tokens=args.max_new_tokens, concurrency=args.concurrency,
                          temperature=args.temperature, ignore_eos=args.ignore_eos, warmup=args.warmup,
                          flush_cache=not args.no_flush, n_boot=args.bootstrap, baseline=args.baseline_url,
                          label=args.label, requested=args.requested, progress=not args.quiet,
                          draft_checksum=adapter.draft_checksum)
        finally:
            client.close()
        if args.json:
            print(json.dumps(res.summary, indent=1, default=_json_default))
        else:
            print(printable(format_summary(res.summary)))
            if len(res.positions):
                print(res.positions.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
        for w in res.warnings:
            print(f"warning: {printable(w)}", file=sys.stderr)
        if not args.no_save:
            run_dir = given_run or new_run_dir(f"measure-{args.label or 'server'}", outputs=outputs)
            with failure_guard("measure", run_dir, owned=given_run is None):
                saved = res.record(run_dir, args.label or "server")
            print(f"run folder: {run_dir} (this measurement: {saved.relative_to(run_dir)})")
        line = failed_requests(res.per_request)
        if line:
            raise RunFailed(f"{line}; see per_request.parquet, column error; the measurement was saved with n_failed")
        return 0

    return run("measure", body)


def _rebuild(run_dir) -> int:
    """``measure --rebuild-ledger RUN_DIR``: :func:`helpers.acceptance.measure.rebuild_ledger`, one line per folder
    left out (stderr), one line of what was done (stdout); exit 1 when a folder was left out."""
    done = rebuild_ledger(run_dir)
    for line in done.skipped:
        print(f"warning: left out: {printable(line)}", file=sys.stderr)
    old = "" if done.kept_old is None else f"; the ledger it replaces was kept as {done.kept_old.name}"
    print(printable(f"rebuilt {done.path}: {len(done.folders)} row(s) from "
                    f"{', '.join(done.folders) or 'no measurement folder'}{old}"))
    if done.skipped:
        raise RunFailed(f"{len(done.skipped)} measurement folder(s) could not be read and are not in the rebuilt "
                        f"ledger (first: {done.skipped[0]})")
    return 0


def _chat_reference(args, tok_dir, show) -> tuple[bool, object]:
    """Whether the bundled prompts go through the chat template (``--training`` chat-formatted with the tokenizer's
    template: :func:`helpers.acceptance.workload.training_is_chat`), and the tokenizer (None when not loaded)."""
    from ..acceptance.workload import has_chat_template, load_tokenizer, training_is_chat  # lazy: only with --training
    from ..formats.training_data import TrainingData  # lazy: torch, only with --training
    if not args.training or tok_dir is None:
        return False, None
    tok = load_tokenizer(tok_dir)
    if not has_chat_template(tok):
        show("the bundled prompts go as they are: the target tokenizer has no chat template")
        return False, tok
    chat = bool(training_is_chat(tok, list(TrainingData(args.training, max_samples=8))))
    show(f"the bundled prompts go {'through the chat template' if chat else 'as they are'}: the training data "
         f"{'was' if chat else 'was not'} chat-formatted with it")
    return chat, tok


def _workload(args, client, adapter, prompts, outputs, given_run, show) -> int:
    """``measure --requests FILE`` (the user's requests against the training-like prompts on the same server,
    :func:`helpers.acceptance.workload.compare_workload`), or ``measure --training DIR`` without it (the bundled
    prompts through the chat template when the training data was chat-formatted)."""
    from ..acceptance.workload import (  # lazy: only with --requests / --training
        fit_context, generation_defaults, load_requests, load_tokenizer, require_vocab, resolve_tokenizer,
        training_like_prompts, vocab_size_of)
    from ..investigation.workload import comparison_text, compare_workload  # lazy: torch, only with --requests
    info = client.server_info(refresh=True)
    tok_dir, note = resolve_tokenizer(info, args.tokenizer)
    show(note)
    chat, tok = _chat_reference(args, tok_dir, show)
    if not args.requests:
        ps = training_like_prompts(args.num_prompts or 48, tokenizer=tok, chat=True) if chat else prompts
        res = measure(client, ps, max_new_tokens=args.max_new_tokens, concurrency=args.concurrency,
                      temperature=args.temperature, ignore_eos=args.ignore_eos, warmup=args.warmup,
                      flush_cache=not args.no_flush, n_boot=args.bootstrap, label=args.label,
                      requested=args.requested, progress=not args.quiet, draft_checksum=adapter.draft_checksum)
        res.summary["chat_template"] = chat
        print(printable(format_summary(res.summary)))
        if not args.no_save:
            run_dir = given_run or new_run_dir(f"measure-{args.label or 'server'}", outputs=outputs)
            with failure_guard("measure", run_dir, owned=given_run is None):
                saved = res.record(run_dir, args.label or "server")
            print(f"run folder: {run_dir} (this measurement: {saved.relative_to(run_dir)})")
        return 0

    loaded = [tok]

    def tokenizer():                              # loaded once, at the first chat body (or for the vocab size)
        if loaded[0] is None:
            if tok_dir is None:
                raise BadInput(f"chat bodies need the target's tokenizer: {note}", field="--tokenizer")
            loaded[0] = load_tokenizer(tok_dir)
        return loaded[0]
    vocab = vocab_size_of(tok_dir, tokenizer if tok_dir is not None else None)
    reqs = load_requests(args.requests, tokenizer=tokenizer, default_max_new_tokens=args.max_new_tokens,
                         gen_defaults=generation_defaults(tok_dir), vocab_size=vocab)
    require_vocab(reqs, vocab, note, args.requests)
    rule = adapter.context_rule(client)     # past the context: refused here as the engine would, or cut with a note
    if rule is not None:
        for n in fit_context(reqs, rule, args.requests, tokenizer=tokenizer() if tok_dir is not None else None):
            print(printable(f"note: {n}"), file=sys.stderr)
    ignored = sorted({k for r in reqs for k in r.ignored})
    if ignored:
        print(printable(f"warning: not sent (the answer may differ from production): {', '.join(ignored)}"),
              file=sys.stderr)
    cmp = compare_workload(client, reqs, max_new_tokens=args.max_new_tokens, tokenizer=tok, reference_chat=chat,
                           n_boot=args.bootstrap, warmup=args.warmup, progress=not args.quiet)
    for name, r in (("your requests", cmp.user), ("training-like prompts", cmp.reference)):
        print(f"== {name}")
        print(printable(format_summary(r.summary)))
    print(printable(comparison_text(cmp)))
    if not args.no_save:
        run_dir = given_run or new_run_dir(f"measure-{args.label or 'requests'}", outputs=outputs)
        with failure_guard("measure", run_dir, owned=given_run is None):
            cmp.user.record(run_dir, "requests")
            cmp.reference.record(run_dir, "training-like")
            atomic_write_text(run_dir / "workload.json", json.dumps(cmp.doc(), indent=1, default=_json_default))
        print(f"run folder: {run_dir} (workload.json: the comparison)")
    line = failed_requests(cmp.user.per_request) or failed_requests(cmp.reference.per_request)
    if line:
        raise RunFailed(f"{line}; see per_request.parquet, column error; the measurement was saved with n_failed")
    return 0
