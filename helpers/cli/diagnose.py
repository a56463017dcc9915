"""``python -m helpers diagnose``: the wiring diagnosis (served aux states vs training data) or, without
``--served``, the config-only check (helpers.diagnosis.static). Exit 0 ok, 1 mismatch or ambiguous, 2 bad input."""
from __future__ import annotations

import argparse
import json
from typing import Optional, Sequence

from ..layers.sglang import parse_version
from ..diagnosis.diagnose import diagnose
from ..draft.config_checks import check_configs
from ..draft.mtp_checks import MTPSpec
from ..engines.detect import BY_NAME, adapter
from ..errors import BadInput
from ..server.protocol import MAX_DRAFT_TOKENS, MAX_NUM_STEPS, MAX_TOPK
from .common import Parser, run


def _version(text: str) -> str:
    """``--sglang-version``: a non-empty X.Y[.Z] (an empty value would silently mean "not given")."""
    if not text.strip():
        raise argparse.ArgumentTypeError("empty value (expected an SGLang version X.Y.Z, e.g. 0.5.23)")
    try:
        parse_version(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def build_parser() -> Parser:
    p = Parser(prog="python -m helpers diagnose",
                description="Compare the aux hidden states a server feeds an EAGLE-3 draft with its training data "
                            "and name the wiring faults; with --draft-config and --target-config only (no --served), "
                            "check the configs alone against SGLang's rules.")
    p.add_argument("--training", help="training data: SpecForge data_*.ckpt[.gz] folder, speculators "
                   "hs_*.safetensors folder, EAGLE data_*.ckpt, or a training dump folder (config-only: only its "
                   "manifest is read)")
    p.add_argument("--served", action="append", help="served aux hidden states: dump folder, SGLang "
                   "/generate response JSON (or a JSON list of them), or SGLang dumper folder; repeat once per TP rank")
    p.add_argument("--draft-config", help="the draft config the server runs with: config.json (only that file is "
                   "read) or its folder (its *.safetensors are read too: fc width, d2t)")
    p.add_argument("--target-config", help="target config.json (or its folder)")
    p.add_argument("--reference", help="reference dump with every layer's hidden states for the same tokens "
                   "(capture --every-layer, or --reference-hf)")
    p.add_argument("--sglang-version", type=_version, help="the server's SGLang version for the capture rules (default: from the "
                   "dump's server block, else 0.5.23)")
    p.add_argument("--trained-layer-ids", type=int, nargs="+", metavar="ID", help="the ids training used, SpecForge "
                   "output-of-layer convention (the run YAML's model.aux_hidden_state_layer_ids)")
    g = p.add_argument_group("speculative settings (config-only check; an MTP / NextN head: the draft config is the "
                             "target's own, or a separate NextN checkpoint)")
    g.add_argument("--speculative-algorithm", help="the server's --speculative-algorithm (EAGLE3, EAGLE, NEXTN; vLLM: "
                   "the speculative_config method, e.g. mtp); default EAGLE3, NEXTN for an MTP head")
    g.add_argument("--speculative-num-steps", type=int, help="--speculative-num-steps (vLLM: num_speculative_tokens)")
    g.add_argument("--speculative-eagle-topk", type=int, help="--speculative-eagle-topk")
    g.add_argument("--speculative-num-draft-tokens", type=int, help="--speculative-num-draft-tokens")
    g.add_argument("--engine", choices=sorted(BY_NAME), help="the engine whose rules check the draft: an EAGLE-3 "
                   "draft (a speculators-format one read as vLLM reads it) or an MTP / NextN head (default sglang; "
                   "vllm: vLLM 0.32.0's)")
    p.add_argument("--json", action="store_true", help="print the JSON document instead of the text report")
    return p


def cli_main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m helpers diagnose ...``: exit 0 ok, 1 mismatch or ambiguous, 2 bad input (one line
    ``diagnose: error: ...`` on stderr; :mod:`helpers.cli.common`)."""

    def body() -> int:
        args = build_parser().parse_args(list(argv) if argv is not None else None)
        if not args.served:
            if not (args.draft_config and args.target_config):
                raise BadInput("usage: give --served (with --training) to compare data, or --draft-config and "
                               "--target-config for the config-only check")
            for flag, most in (("speculative_num_steps", MAX_NUM_STEPS), ("speculative_eagle_topk", MAX_TOPK),
                               ("speculative_num_draft_tokens", MAX_DRAFT_TOKENS)):
                v = getattr(args, flag)
                if v is not None and not 1 <= v <= most:
                    raise BadInput(f"expected an integer 1-{most} (the range helpers.server.protocol accepts from a "
                                   f"server), got {v}", field="--" + flag.replace("_", "-"))
            spec = MTPSpec(algorithm=args.speculative_algorithm, num_steps=args.speculative_num_steps,
                           topk=args.speculative_eagle_topk, num_draft_tokens=args.speculative_num_draft_tokens)
            loader = None if args.engine is None else adapter(args.engine).loader_rules(args.sglang_version)
            result = check_configs(args.draft_config, args.target_config, training=args.training,
                                   sglang_version=args.sglang_version, trained_layer_ids=args.trained_layer_ids,
                                   algorithm=args.speculative_algorithm, spec=spec, loader=loader)
        else:
            if not args.training:
                raise BadInput("usage: --served needs --training (the data the draft was trained on)")
            result = diagnose(args.training, args.served, draft_config=args.draft_config,
                              target_config=args.target_config, reference=args.reference,
                              sglang_version=args.sglang_version, trained_layer_ids=args.trained_layer_ids)
        print(json.dumps(result.to_json(), indent=1) if args.json else result.render_text())
        return 0 if result.verdict == "ok" else 1

    return run("diagnose", body, unexpected_exit=2)
