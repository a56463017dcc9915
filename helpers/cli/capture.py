"""``python -m helpers capture``: dump what a live server feeds its EAGLE-3 draft for the training samples' tokens,
with every layer from HF (``--reference-hf``) or from the server's own hooks (``--every-layer``)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional, Sequence

from ..capture import capture_every_layer, capture_reference_hf, capture_served
from ..errors import BadInput
from ..formats.configs import read_target_config
from ..formats.training_data import TrainingData
from ..runfiles import mark_failed, new_run_dir
from ..server.client import SGLangClient
from .common import Parser, describe, progress_line, run

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
    ap.add_argument("--name", default="served", help="dump folder name under dumps/ (must not exist)")
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
        if args.num_samples < 1 or args.timeout <= 0:
            raise BadInput("--num-samples must be >= 1 and --timeout > 0")
        H = args.hidden_size
        if H is None and args.reference_hf:
            H = read_target_config(args.reference_hf).hidden_size
        td = TrainingData(args.training, hidden_size=H, max_samples=args.num_samples)
        samples = list(td)
        H = H or td.hidden_size
        if args.run_dir and not Path(args.run_dir).is_dir():
            raise BadInput("--run-dir must be an existing folder (omit it for a new run folder)", path=args.run_dir)
        run_dir = Path(args.run_dir) if args.run_dir else new_run_dir("capture")
        dumps = run_dir / "dumps"
        show = progress_line("capture")
        client = SGLangClient(args.url, os.environ.get("SGLANG_API_KEY") or None, deadline_s=args.timeout,
                              on_wait=show)
        try:
            return _capture(args, client, samples, dumps, H)
        except BaseException as exc:
            if not args.run_dir:            # a run folder made for this capture: removed if empty, else marked
                mark_failed(run_dir, f"capture: {describe(exc)}")
            raise
        finally:
            client.close()

    return run("capture", body)


def _capture(args, client, samples, dumps, H) -> int:
    """The dumps of one ``capture`` run (served, then the references asked for); prints each folder."""
    print(capture_served(client, samples, dumps, name=args.name, max_new_tokens=1, progress=True,
                         max_width=None if not H else 16 * H))
    if args.reference_hf:
        print(capture_reference_hf(args.reference_hf, samples, dumps, name=f"{args.name}-reference-hf",
                                   progress=True))
    if args.every_layer:
        print(capture_every_layer(client, samples, args.every_layer, dumps, name=f"{args.name}-reference-server",
                                  progress=True))
    return 0
