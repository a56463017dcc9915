"""``python -m helpers capture``: dump what a live server feeds its EAGLE-3 draft for the training samples' tokens,
with every layer from HF (``--reference-hf``) or from the server's own hooks (``--every-layer``)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional, Sequence

from ..capture import capture_every_layer, capture_reference_hf, capture_served
from ..errors import BadInput, SGLangError, one_line
from ..formats.training_data import TrainingData
from ..runfiles import new_run_dir


def cli_main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m helpers capture --url URL --training PATH [--num-samples N] [--run-dir DIR]
    [--name NAME] [--reference-hf TARGET] [--every-layer DIR]``: dump what a live server feeds the draft for the
    first training samples (one served row per training row), optionally with every layer's residual stream
    from HF (``--reference-hf``) or from the server's own hooks (``--every-layer``: the folder its
    ``--capture-layers`` hooks write to); print the dump folders. The API key is read from ``$SGLANG_API_KEY``.

    Exit codes: 0 written; 2 bad input or an unusable server (one line on stderr).
    """


    ap = argparse.ArgumentParser(prog="python -m helpers capture",
                                 description="Dump the aux hidden states a live SGLang server feeds its "
                                             "EAGLE-3 draft, for the tokens of the training data.")
    ap.add_argument("--url", required=True, help="server URL, e.g. http://127.0.0.1:30000")
    ap.add_argument("--training", required=True, help="training data (SpecForge / speculators / dump)")
    ap.add_argument("--num-samples", type=int, default=4, help="training samples to send (default 4)")
    ap.add_argument("--run-dir", default=None, help="run folder to write dumps/ into (default: a new "
                                                    "outputs/<stamp>-capture/)")
    ap.add_argument("--name", default="served", help="dump folder name under dumps/ (must not exist)")
    ap.add_argument("--reference-hf", default=None, metavar="TARGET",
                    help="also dump every layer of this HF target folder for the same tokens")
    ap.add_argument("--every-layer", default=None, metavar="DIR",
                    help="also record every layer from the server itself: DIR is the folder its every-layer hooks "
                         "write to (server start --capture-layers DIR; GPU: env/gpu/launch_tp8.sh LAYERS_DIR=DIR)")
    ap.add_argument("--hidden-size", type=int, default=None, help="target hidden size (default: from "
                                                                  "--reference-hf's config or the data)")
    args = ap.parse_args(argv)
    try:

        H = args.hidden_size
        if H is None and args.reference_hf:
            H = json.loads((Path(args.reference_hf) / "config.json").read_text())["hidden_size"]
        samples = list(TrainingData(args.training, hidden_size=H, max_samples=args.num_samples))
        run_dir = Path(args.run_dir) if args.run_dir else new_run_dir("capture")
        dumps = run_dir / "dumps"
        served = capture_served(args.url, samples, dumps, name=args.name, max_new_tokens=1, progress=True)
        print(served)
        if args.reference_hf:
            print(capture_reference_hf(args.reference_hf, samples, dumps, name=f"{args.name}-reference-hf",
                                       progress=True))
        if args.every_layer:
            print(capture_every_layer(args.url, samples, args.every_layer, dumps, name=f"{args.name}-reference-server",
                                      progress=True))
    except (BadInput, SGLangError, FileExistsError, FileNotFoundError, ValueError, OSError) as exc:
        print(f"error: {one_line(exc)}", file=sys.stderr)
        return 2
    return 0
