"""``python -m helpers compare-engines``: the same draft on two servers (typically SGLang and vLLM), the same prompts
on both, paired per prompt (helpers.investigation.cross_engine).

Exit 0 when the servers accept the same within the CI, 1 when a difference beyond its CI is found (named with its
stage, or undecided), 2 bad input."""
from __future__ import annotations

import json
import os
from typing import Optional, Sequence

from ..errors import BadInput
from ..redaction import url_label
from ..investigation.cross_engine import compare_engines
from ..formats.configs import read_target_config
from ..redaction import redact_url
from ..server.client import check_url, server_key
from ..runfiles import new_run_dir, safe_name
from .common import Parser, failure_guard, out_folder, progress_line, run


def build_parser() -> Parser:
    p = Parser(prog="python -m helpers compare-engines",
               description="Serve one draft on two servers (SGLang, vLLM, or two of one engine), send the same prompts "
                           "to both, pair the answers per prompt: accept length and P(accepted >= j) per draft "
                           "position with paired CIs; a difference beyond its CI is named with the acceptance budget's "
                           "stage it comes from (wiring, engine, settings, draft).")
    p.add_argument("--a", required=True, metavar="URL", help="the first server's base URL")
    p.add_argument("--b", required=True, metavar="URL", help="the second server's base URL")
    p.add_argument("--training", required=True, help="the draft's training data (the wiring stage's tokens)")
    p.add_argument("--target", metavar="DIR", help="the target folder (its config.json; weights optional) read here "
                   "for a server whose own model_path is not readable on this machine; both servers must serve this "
                   "target")
    p.add_argument("--prompts", type=int, default=16, help="live prompts, the same on both (default 16)")
    p.add_argument("--max-new-tokens", type=int, default=32, help="tokens per prompt (default 32)")
    p.add_argument("--samples", type=int, default=4, help="training samples for the wiring stage (default 4)")
    p.add_argument("--out", help="folder under which the run folder is created (default outputs/)")
    p.add_argument("--timeout", type=float, default=1800.0, help="overall budget in seconds (default 1800)")
    p.add_argument("--api-key-env", default=None, help="NAME of the environment variable holding the servers' API "
                   "key (default: each engine's own, SGLANG_API_KEY / VLLM_API_KEY; the key is never written)")
    p.add_argument("--json", action="store_true", help="print the document (results/compare-engines.json)")
    return p


def cli_main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m helpers compare-engines ...`` (module docstring)."""
    prog = "compare-engines"

    def body() -> int:
        args = build_parser().parse_args(list(argv) if argv is not None else None)
        for flag, url in (("--a", args.a), ("--b", args.b)):     # both before any request
            check_url(url, flag)
        if server_key(args.a) == server_key(args.b):
            raise BadInput(f"--a and --b name the same server ({redact_url(args.b)}): compare-engines compares two "
                           "servers (the same draft on two engines or two settings); pass the second one's URL as --b")
        if args.target is not None:                  # a folder with a readable config.json, before any request
            try:
                read_target_config(args.target)
            except BadInput as exc:
                raise BadInput(str(exc), field="--target") from None
        if args.prompts < 2 or args.samples < 1 or args.max_new_tokens < 2:
            raise BadInput("--prompts must be >= 2 (a paired CI), --samples >= 1, --max-new-tokens >= 2")
        out = out_folder(args.out, "--out")
        host = safe_name(url_label(args.b))          # no credentials in a folder name
        run_dir = new_run_dir(f"compare-engines-{host}", out)
        show = progress_line(prog)
        show(f"run folder {run_dir}")
        with failure_guard(prog, run_dir):
            doc = compare_engines(args.a, args.b, training=args.training, run_dir=run_dir, prompts=args.prompts,
                                  max_new_tokens=args.max_new_tokens, num_samples=args.samples,
                                  api_key=os.environ.get(args.api_key_env) if args.api_key_env else None,
                                  timeout=args.timeout, target=args.target, progress=show)
        if args.json:
            print(json.dumps(doc, indent=1, default=str))
        else:
            print(doc["sentence"])
            for pos in doc["live"]["positions"]:
                print(f"  P(accepted >= {pos['position']}): a {pos['a']:.3f}, b {pos['b']:.3f}, b - a "
                      f"{pos['delta']:+.3f} [{pos['delta_lo']:+.3f}, {pos['delta_hi']:+.3f}]")
            for n in doc.get("notes") or []:
                print(f"note: {n}")
            print(f"results: {run_dir / 'results' / 'compare-engines.json'}")
        return 1 if doc["beyond_ci"] else 0

    return run(prog, body)
