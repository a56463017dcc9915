"""``python -m helpers capture``: dump what a live server feeds its EAGLE-3 draft for the training samples' tokens,
with every layer from HF (``--reference-hf``) or from the server's own hooks (``--every-layer``)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional, Sequence

from ..budget import Budget
from ..capture import capture_every_layer, capture_reference_hf
from ..errors import BadInput
from ..formats.configs import read_target_config
from ..formats.training_data import TrainingData
from ..runfiles import new_run_dir
from ..server.client import check_url
from ..engines.detect import detect_or
from .common import Parser, failure_guard, progress_line, run, run_folder_arg, text_arg

DEFAULT_TIMEOUT = 1800.0


def build_parser() -> Parser:
    ap = Parser(prog="python -m helpers capture",
                description="Dump the aux hidden states a live SGLang server feeds its EAGLE-3 draft, for the tokens "
                            "of the training data. The API key is read from $SGLANG_API_KEY.")
    ap.add_argument("--url", required=True, help="server URL, e.g. http://127.0.0.1:30000")
    ap.add_argument("--training", required=True, help="training data (SpecForge / speculators / dump)")
    ap.add_argument("--num-samples", type=int, default=4, help="training samples to send (default 4)")
    ap.add_argument("--run-dir", default=None, help="an existing run folder to write dumps/ into (default: a new "
                                                    "outputs/<stamp>-capture/)")
    ap.add_argument("--name", default="served", help="dump folder name under dumps/ (a plain name; must not exist)")
    ap.add_argument("--reference-hf", default=None, metavar="TARGET",
                    help="also dump every layer of this HF target folder for the same tokens")
    ap.add_argument("--every-layer", default=None, metavar="DIR",
                    help="also record every layer from the server itself: DIR is the folder its every-layer hooks "
                         "write to (server start --capture-layers DIR; GPU: env/gpu/launch_tp8.sh LAYERS_DIR=DIR)")
    ap.add_argument("--hidden-size", type=int, default=None, help="target hidden size (default: from "
                                                                  "--reference-hf's config or the data)")
    ap.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT,
                    help=f"overall budget in seconds for the server's answers (default {DEFAULT_TIMEOUT:.0f}: a "
                         "loaded TP 8 GPU server answering 4 long prompts)")
    return ap


def cli_main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m helpers capture --url URL --training PATH [...]``: write the dumps and print their folders.

    Exit codes: 0 written; 1 the server failed (unreachable, timed out, answers without usable hidden states); 2 bad
    input. One line ``capture: error: ...`` on stderr (:mod:`helpers.cli.common`)."""

    def body() -> int:
        args = build_parser().parse_args(list(argv) if argv is not None else None)
        check_url(args.url)                        # before the run folder is made
        if args.num_samples < 1 or not args.timeout > 0:
            raise BadInput("--num-samples must be >= 1 and --timeout > 0")
        if args.hidden_size is not None and args.hidden_size < 1:
            raise BadInput(f"--hidden-size must be >= 1, got {args.hidden_size}")
        if args.every_layer is not None and Path(args.every_layer).exists() and not Path(args.every_layer).is_dir():
            raise BadInput("--every-layer must be the folder the server's every-layer hooks write to, not a file",
                           path=args.every_layer)
        names = dump_names(args)
        H = args.hidden_size
        if H is None and args.reference_hf:
            H = read_target_config(args.reference_hf).hidden_size
        td = TrainingData(args.training, hidden_size=H, max_samples=args.num_samples)
        samples = list(td)
        H = H or td.hidden_size
        given_run = run_folder_arg(args.run_dir)
        for name in names if given_run is not None else ():
            if (given_run / "dumps" / name).exists():
                raise BadInput("the dump folder exists (dumps are never overwritten): pick another --name",
                               path=given_run / "dumps" / name)
        run_dir = given_run or new_run_dir("capture")
        dumps = run_dir / "dumps"
        show = progress_line("capture")
        key = os.environ.get("SGLANG_API_KEY") or None
        budget = Budget(args.timeout)          # the command's one deadline: detection, then every request
        adapter = detect_or(args.url, key, budget=budget, on_wait=show)   # the engine, once
        client = adapter.client(args.url, key, budget=budget, on_wait=show)
        try:
            with failure_guard("capture", run_dir, owned=given_run is None):   # removed if empty, else marked
                return _capture(args, adapter, client, samples, dumps, H)
        finally:
            client.close()

    return run("capture", body)


def dump_names(args) -> list[str]:
    """The dump folders this capture writes under ``dumps/`` (``--name``, and ``<name>-reference-hf`` /
    ``<name>-reference-server`` when asked for).

    Raises:
        BadInput: ``--name`` is not a plain folder name (a path, ``..``, an absolute path, not UTF-8): a dump never
            goes outside ``<run>/dumps/``.
    """
    name = text_arg(args.name, "--name")
    if not name or name in (".", "..") or "/" in name or "\0" in name or Path(name).name != name:
        raise BadInput(f"--name {name!r} must be a plain folder name (no '/', not '..'): the dump goes to "
                       "<run>/dumps/<name>/")
    return [name] + ([f"{name}-reference-hf"] if args.reference_hf else []) + (
        [f"{name}-reference-server"] if args.every_layer else [])


def _capture(args, adapter, client, samples, dumps, H) -> int:
    """The dumps of one ``capture`` run (served through the server's engine adapter, then the references asked
    for); prints each folder."""
    print(adapter.capture_served(client, samples, dumps, name=args.name, max_new_tokens=1, progress=True,
                                 max_width=None if not H else 16 * H))
    if args.reference_hf:
        print(capture_reference_hf(args.reference_hf, samples, dumps, name=f"{args.name}-reference-hf",
                                   progress=True))
    if args.every_layer:
        print(capture_every_layer(client, samples, args.every_layer, dumps, name=f"{args.name}-reference-server",
                                  progress=True))
    return 0
