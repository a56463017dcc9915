"""``python -m helpers investigate``: the live investigation of a running server (helpers.investigation.live).

Exit 0 when nothing is wrong (no finding, and every stage of the acceptance budget rules a material loss out), 1 when a
fault is named or the budget is undecided (or the server failed), 2 bad input.

``--check-draft``: only the served-draft checks (:mod:`helpers.investigation.check_draft`), no training data needed;
exit 0 the served draft matches its checkpoint, 1 it differs (or the server failed), 2 bad input, 3 undecided (the
check could not run: its line says how to get the evidence)."""
from __future__ import annotations

import json
import os
from typing import Optional, Sequence

from ..acceptance.sweeps import SWEEPS
from ..errors import BadInput, describe
from ..formats.configs import read_draft_config, read_target_config
from ..server.client import check_url
from ..server.embedded import parse_ports
from ..server.restart import relaunch_argv
from ..investigation.check_draft import EXIT as CHECK_EXIT, check_draft, check_timeout, \
    default_run_dir as check_draft_run_dir, verdict_line
from ..investigation.live import default_run_dir, investigate
from ..investigation.probes import CHOICES as PROBE_CHOICES
from ..investigation.probes.sampled import check_sampling
from ..views.common import run_dir_line
from ..views.investigation import write_report
from .common import Parser, failure_guard, input_path_arg, out_folder, progress_line, rows_arg, run, subset_arg


def build_parser() -> Parser:
    p = Parser(prog="python -m helpers investigate",
               description="Attach to a running SGLang or vLLM server with an EAGLE-3 draft (the engine is detected "
                           "from its own endpoints), capture what it feeds the draft, "
                           "compare with the training data (and every layer of the target), name the fault, propose "
                           "the fix and, when the server can be restarted, measure the fix before/after.")
    p.add_argument("--url", required=True, help="the server's base URL, e.g. http://127.0.0.1:30000")
    p.add_argument("--training", help="the draft's training data (SpecForge folder, speculators "
                   "hs_*.safetensors folder, EAGLE data, or a training dump). Without it, the layer plan an EAGLE-3 "
                   "draft was trained on is identified from the draft itself (its loss on the server's own "
                   "continuations under each candidate plan; docs/no-training-data.md) and the run stops, exit 2, when "
                   "that is undecided; an MTP / NextN head needs none (docs/mtp.md)")
    p.add_argument("--check-draft", action="store_true", help="only check that the served draft is its checkpoint: "
                   "attach, the engine's draft weights checksum where it has one, and the served draft's proposals "
                   "step by step against the checkpoint's (needs `server start --trace-draft DIR`); exit 0 matches, "
                   "1 differs, 3 undecided. Uses --draft, --target, --out, --timeout (default 300; at least 60 s more "
                   "than a probe's estimate), --prompts (default 3), --max-new-tokens (default 16), --api-key-env, "
                   "--json; any other flag is refused")
    p.add_argument("--draft", help="the draft folder, when the server's (speculative_draft_model_path) is not "
                   "readable here; when both are, a difference is reported")
    p.add_argument("--target", help="the target folder (config.json; weights allow an HF reference), when the "
                   "server's model_path is not readable here")
    p.add_argument("--relaunch", metavar="CMD", help="the server's launch command (one string); the tool starts a "
                   "copy with the proposed fix (draft path, port and flags replaced) and measures before/after. "
                   "Servers started with `python -m helpers server start` are restarted without it")
    p.add_argument("--no-apply", action="store_true", help="only propose the fix (no restart, no measurement)")
    p.add_argument("--no-measure", action="store_true", help="send no live prompts for the acceptance budget (its "
                   "engine stage is then missing); the offline stages still run")
    p.add_argument("--no-budget", action="store_true", help="skip the acceptance budget (wiring diagnosis only)")
    p.add_argument("--validation", metavar="DIR", help="rows of the training log's kind (its validation split, the "
                   "same text distribution) for the draft stage: the checkpoint's teacher-forced accuracy per step on "
                   "them is compared with the log's (default: a 'validation' folder beside --training or in the draft "
                   "folder, else --training itself)")
    p.add_argument("--rows", metavar="SPLIT[,TEXT]", help="what the draft stage's rows are, when their capture.json "
                   "does not say: a split (validation|training) and/or a text kind (sampled|greedy|mixed|dataset), "
                   "e.g. validation,sampled")
    p.add_argument("--draft-cost", type=float, metavar="R", help="one draft forward's cost relative to one verify "
                   "step, for the settings stage (default: the ratio of parameters from the safetensors headers; give a "
                   "timing's ratio for a mixture-of-experts target, whose tokens read only their experts)")
    p.add_argument("--engine-probes", default="cheap", choices=PROBE_CHOICES,
                   help="engine-state probes after the acceptance budget: cheap (default: on the live server, the "
                   "prompts with their prefix in the radix cache against cold), all (also restarted copies: chunked "
                   "prefill, the target alone at temperature 0 for greedy losslessness; needs a server the tool can "
                   "restart), none")
    p.add_argument("--probe-temperature", type=float, default=None,
                   help="the temperature of the sampled-verify engine-state probe (default 1.0; > 0): the live prompts "
                   "sampled, the engine's accept length against the draft run offline on the same answers")
    p.add_argument("--probe-top-p", type=float, default=None, help="its top-p (default 1.0)")
    p.add_argument("--probe-top-k", type=int, default=None, help="its top-k (default -1: off)")
    p.add_argument("--requests", metavar="FILE", help="your workload: JSONL of OpenAI chat / completions or SGLang "
                   "/generate bodies, replayed with their own sampling params after the budget against the bundled "
                   "training-like prompts on the same server (a requests_accept_less finding when yours accept "
                   "materially less; docs/workload.md)")
    p.add_argument("--tokenizer", metavar="DIR", help="the target's tokenizer folder for --requests' chat bodies "
                   "(default: the server's tokenizer_path / model_path, else --target)")
    p.add_argument("--training-log", help="the draft's training log (SpecForge / TorchSpec / speculators / EAGLE / "
                   "this tool's); default: training_log.json or trainer_state.json in the draft folder or its parent")
    p.add_argument("--sweeps", default="auto", help="workload sweeps after the acceptance budget (no restart): auto "
                   "(context and concurrency, only when the budget leaves the loss unexplained), none, or a "
                   "comma-separated subset of context,temperature,concurrency (default auto; `ablate` runs more)")
    p.add_argument("--port", metavar="PORT|LOW-HIGH", help="port of the fixed server the tool starts (on 127.0.0.1 "
                   "for an embedded server), or a range to take a free one from (default: a free port of "
                   "$E3F_PORT_RANGE, else 12000-19999)")
    p.add_argument("--out", help="folder under which the run folder is created (default outputs/)")
    p.add_argument("--timeout", type=float, help="overall budget in seconds (default 900; --check-draft 300)")
    p.add_argument("--samples", type=int, default=4, help="training samples to capture and compare (default 4)")
    p.add_argument("--prompts", type=int, help="prompts for the before/after measurement (default 16; --check-draft: "
                   "traced prompts, default 3)")
    p.add_argument("--max-new-tokens", type=int, help="tokens per prompt when measuring (default 32; --check-draft "
                   "16)")
    p.add_argument("--api-key-env", default="SGLANG_API_KEY", help="NAME of the environment variable holding the "
                   "server's API key (default SGLANG_API_KEY; the key is never written)")
    p.add_argument("--json", action="store_true", help='print {"verdict", "findings", "proposed_fix", "measured", '
                   '"sentence", "run_dir"} instead of the report')
    return p


def cli_main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m helpers investigate ...`` (module docstring)."""
    prog = "investigate"

    def body() -> int:
        args = build_parser().parse_args(list(argv) if argv is not None else None)
        check_url(args.url)                        # before the run folder is made (a FAILED folder otherwise)
        quick = args.check_draft
        for name, full, check in (("timeout", 900.0, 300.0), ("prompts", 16, 3), ("max_new_tokens", 32, 16)):
            if getattr(args, name) is None:
                setattr(args, name, check if quick else full)
        if quick:
            _check_draft_flags(args, argv)
            return _check_draft(args, prog)
        if args.training is not None and not args.training.strip():
            raise BadInput("--training is empty: give the draft's training data, or leave the flag out to identify "
                           "the layer plan from the draft itself")
        if args.samples < 1 or args.prompts < 1:
            raise BadInput("--samples and --prompts must be >= 1")
        if args.timeout is not None and not 0 < args.timeout < float("inf"):
            raise BadInput(f"--timeout must be > 0 seconds and finite, got {args.timeout}")
        check_sampling(_probe_sampling(args))      # a greedy or absurd probe sampling: exit 2 naming the flag
        if args.draft_cost is not None and not 0 < args.draft_cost < 10:
            raise BadInput(f"{args.draft_cost} is no ratio in (0, 10) (a draft forward's cost over a verify "
                           "step's, e.g. 0.05)", field="--draft-cost")
        parse_ports(args.port, what="--port")
        # the files it reads, before any request or folder (a symlink loop, a FIFO, an unreadable config.json)
        input_path_arg(args.training, "--training")
        input_path_arg(args.training_log, "--training-log", folder=False)
        input_path_arg(args.validation, "--validation")
        input_path_arg(args.requests, "--requests", folder=False)
        input_path_arg(args.tokenizer, "--tokenizer", folder=True)
        if args.requests:                          # every line checked before any work
            _check_requests(args)
        _folders(args)
        out = out_folder(args.out, "--out")
        sweeps = "auto" if args.sweeps.strip() == "auto" else subset_arg(args.sweeps, SWEEPS, "--sweeps")
        rows_word = rows_arg(args.rows)
        if args.relaunch:
            relaunch_argv(args.relaunch)           # a command line that cannot run is bad input, before any request
        run_dir = default_run_dir(out, args.url)
        show = progress_line(prog)
        show(f"run folder {run_dir}")
        show(f"to open it in the notebooks, paste into their parameters cell: {run_dir_line(run_dir)}")
        try:
            with failure_guard(prog, run_dir):        # investigation.json keeps what was done; FAILED says why
                doc = _investigate(args, run_dir, rows_word, sweeps, show)
                report = write_report(run_dir, doc)
        except Exception as exc:
            if args.json:                             # --json always prints one JSON document; the line goes on
                print(json.dumps({"verdict": "error", "error": describe(exc), "findings": [],
                                  "run_dir": str(run_dir)}, indent=1))
            raise
        if args.json:
            print(json.dumps({"verdict": doc.verdict, "findings": [f.model_dump(mode="json") for f in doc.findings],
                              "proposed_fix": None if doc.proposed_fix is None else doc.proposed_fix.model_dump(
                                  mode="json"), "measured": doc.measured, "sentence": doc.sentence,
                              "acceptance": doc.acceptance, "engine_state": doc.engine_state, "notes": doc.notes,
                              "seconds_to_verdict": doc.seconds_to_verdict, "run_dir": str(run_dir)}, indent=1))
        else:
            print(doc.sentence)
            for n in doc.notes:
                print(f"note: {n}")
            print(f"postmortem: {report}")
        return 0 if doc.verdict == "ok" else 1

    return run(prog, body)


def _check_requests(args) -> None:
    """``--requests`` read and checked whole before any request or folder. With ``--tokenizer`` (the tokenizer the
    workload stage uses first: :func:`helpers.acceptance.workload.resolve_tokenizer`) its chat bodies are rendered
    now (a tokenizer without a chat template, a template error) and its token ids checked against the target's
    vocab size (``--target``'s config, else the tokenizer folder's, else the tokenizer's length); without it the
    server names the tokenizer, so chat bodies are rendered and ids checked right after attach
    (:func:`helpers.investigation.workload.workload_check`), still before any other request.

    Raises: BadInput naming the file, the line and the field."""
    from ..acceptance.workload import CHECK_ONLY, load_requests, load_tokenizer, vocab_size_of  # lazy: --requests
    if not args.tokenizer:
        load_requests(args.requests, tokenizer=CHECK_ONLY)
        return
    load_requests(args.requests, tokenizer=CHECK_ONLY)      # the file's own faults first, without transformers
    tok = load_tokenizer(args.tokenizer)
    load_requests(args.requests, tokenizer=tok, default_max_new_tokens=args.max_new_tokens,
                  vocab_size=vocab_size_of(args.target) or vocab_size_of(args.tokenizer, tok))


def _folders(args) -> None:
    """``--draft`` / ``--target`` read with the readers the investigation uses on them, before any work (a symlink
    loop, a FIFO, an unreadable config.json: one line naming the flag)."""
    for flag, folder, read in (("--draft", args.draft, read_draft_config),
                               ("--target", args.target, read_target_config)):
        if input_path_arg(folder, flag) is not None:
            try:
                read(folder)
            except BadInput as exc:
                raise BadInput(str(exc), field=exc.field or flag) from None


#: the flags ``--check-draft`` uses (by their argparse ``dest``); any other given is refused, not silently ignored
CHECK_DRAFT_FLAGS = ("url", "check_draft", "draft", "target", "out", "timeout", "prompts", "max_new_tokens",
                     "api_key_env", "json")


def _check_draft_flags(args, argv: Optional[Sequence[str]]) -> None:
    """Refuse a flag ``--check-draft`` does not use (``--training``, ``--sweeps``, ``--relaunch``, ...): one line
    naming it and the flags it takes, before any request. A flag counts as given when its value is not the parser's
    default."""
    parser = build_parser()
    names = {a.dest: a.option_strings[0] for a in parser._actions if a.option_strings}
    given = [names[d] for d in names if d not in CHECK_DRAFT_FLAGS and d != "help"
             and getattr(args, d, None) != parser.get_default(d)]
    if given:
        raise BadInput(f"--check-draft takes only {', '.join(names[d] for d in CHECK_DRAFT_FLAGS)}; got "
                       f"{', '.join(given)}")


def _check_draft(args, prog: str) -> int:
    """``investigate --check-draft`` (:func:`helpers.investigation.check_draft.check_draft`): the verdict line (or
    the document with ``--json``) on stdout, exit :data:`helpers.investigation.check_draft.EXIT`."""
    if args.prompts < 1 or args.max_new_tokens < 2:
        raise BadInput(f"--check-draft needs --prompts >= 1 and --max-new-tokens >= 2, got {args.prompts} and "
                       f"{args.max_new_tokens}")
    if not 0 < args.timeout < float("inf"):
        raise BadInput(f"--timeout must be > 0 seconds and finite, got {args.timeout}")
    check_timeout(args.timeout, args.prompts, args.max_new_tokens)
    _folders(args)
    out = out_folder(args.out, "--out")
    run_dir = check_draft_run_dir(out, args.url)
    show = progress_line(prog)
    show(f"run folder {run_dir}")
    with failure_guard(prog, run_dir):
        doc = check_draft(args.url, run_dir=run_dir, draft=args.draft, target=args.target,
                          api_key=os.environ.get(args.api_key_env) or None, timeout=args.timeout,
                          prompts=args.prompts, max_new_tokens=args.max_new_tokens, progress=show)
    if args.json:
        print(json.dumps(doc, indent=1, default=str))
    else:
        print(verdict_line(doc))
        for n in doc["notes"]:
            print(f"note: {n}")
    return CHECK_EXIT[doc["verdict"]]



def _investigate(args, run_dir, rows_word, sweeps, show):
    """:func:`helpers.investigation.live.investigate` with the command line's arguments."""
    return investigate(args.url, training=args.training, run_dir=run_dir, draft=args.draft, target=args.target,
                       validation=args.validation, rows_word=rows_word,
                       relaunch=args.relaunch, api_key=os.environ.get(args.api_key_env) or None,
                       timeout=args.timeout, num_samples=args.samples, measure_prompts=args.prompts,
                       max_new_tokens=args.max_new_tokens, apply_fix=not args.no_apply, port=args.port,
                       acceptance_budget=not args.no_budget, live_measure=not args.no_measure,
                       training_log=args.training_log, sweeps=sweeps, draft_cost=args.draft_cost,
                       engine_probes=args.engine_probes, probe_sampling=_probe_sampling(args),
                       requests=args.requests, tokenizer=args.tokenizer, progress=show)


def _probe_sampling(args) -> Optional[dict]:
    """``--probe-temperature`` / ``--probe-top-p`` / ``--probe-top-k`` as the sampled-verify probe's sampling (None
    when none is given)."""
    out = {k: v for k, v in (("temperature", args.probe_temperature), ("top_p", args.probe_top_p),
                             ("top_k", args.probe_top_k)) if v is not None}
    return out or None
