"""``python -m helpers simulate``: the draft checkpoint run offline as SGLang 0.5.23 runs it, drafting and verifying
greedily on aux hidden states (the training data's, and a served capture's when given), with the training log's
prediction, the draft checks and the accept length at other ``--speculative-num-steps`` (helpers.draft).

The draft stage measures the checkpoint as its trainer measured it (teacher-forced accuracy and loss per TTT step) on
rows of the training log's kind (``--validation``, or a ``validation`` folder beside ``--training``) and compares it
with the log, step by step.

Exit 0 when every stage computed offline (the draft stage, the settings stage, and the wiring stage with ``--served``)
rules out a material loss, 1 when a stage loses a material share beyond its CI or cannot be decided, 2 bad input (a
checkpoint whose keys or shapes do not match its config, a missing target embedding, a training log in an unknown
format, settings SGLang refuses)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Sequence

import torch

from ..draft.budget import acceptance_budget
from ..draft.checks import draft_checks
from ..draft.offline import offline_inputs
from ..draft.precision import DTYPE_NAMES, choose_dtype, server_dtype
from ..draft.simulate import DraftSettings
from ..server.settings import default_draft_tokens
from ..draft.model import DraftArch
from ..draft.training_log import find_training_log, read_training_log
from ..errors import BadInput
from ..formats.configs import read_draft_config, read_target_config
from .common import Parser, progress_line, rows_arg, run


def build_parser() -> Parser:
    p = Parser(prog="python -m helpers simulate",
               description="Run an EAGLE-3 draft checkpoint offline as SGLang 0.5.23 runs it and replay its drafting "
                           "(chain for topk 1, the k x k beam and top N-1 tree for topk > 1) against the target's "
                           "greedy tokens: accept length, accept rate and P(accepted >= j) per position, on the "
                           "training data's aux states and on a served capture's.")
    p.add_argument("--draft", required=True, help="the draft folder (config.json + safetensors, sharded or not)")
    p.add_argument("--target", required=True, help="the target folder: config.json and the safetensors holding "
                   "embed_tokens (only that tensor, and lm_head when the draft borrows it, is read)")
    p.add_argument("--training", required=True, help="the draft's training data (SpecForge, speculators, EAGLE, dump)")
    p.add_argument("--served", help="a served capture of the same training tokens (a dump from `capture`, or the "
                   "run folder's dumps/server-served): the wiring stage, paired per sample")
    p.add_argument("--draft-cost", type=float, metavar="R", help="one draft forward's cost relative to one verify "
                   "step, for the settings stage (default: the ratio of parameters from the safetensors headers; give a "
                   "timing's ratio for a mixture-of-experts target, whose tokens read only their experts)")
    p.add_argument("--steps", type=int, default=3, help="--speculative-num-steps (default 3)")
    p.add_argument("--topk", type=int, default=1, help="--speculative-eagle-topk (default 1)")
    p.add_argument("--draft-tokens", type=int, default=None, help="--speculative-num-draft-tokens (default steps + 1)")
    p.add_argument("--samples", type=int, default=16, help="training samples to use (default 16)")
    p.add_argument("--training-log", help="the draft's training log (default: looked for in the draft folder)")
    p.add_argument("--validation", metavar="DIR", help="rows of the training log's kind for the draft stage "
                   "(default: a 'validation' folder beside --training or in the draft folder, else --training)")
    p.add_argument("--rows", metavar="SPLIT[,TEXT]", help="what the draft stage's rows are when their capture.json "
                   "does not say, e.g. validation,sampled")
    p.add_argument("--dtype", choices=["auto", "bfloat16", "float16", "float32"], default="auto",
                   help="compute dtype (default auto: the server's, taken as the draft config's torch_dtype as "
                   "SGLang's --dtype auto does, where this device computes it natively, else float32; the output "
                   "says which and why)")
    p.add_argument("--device", default="cpu", help="torch device (default cpu; cuda when a GPU is here)")
    p.add_argument("--json", action="store_true", help="print the budget document as JSON")
    return p


def _device(name: str) -> torch.device:
    """``--device`` as a torch device this machine has.

    Raises:
        BadInput: not a device name, or a device this machine lacks (no CUDA, an index past the GPU count).
    """
    try:
        dev = torch.device(name)
        torch.empty(0, device=dev)
    except (RuntimeError, AssertionError, ValueError) as exc:
        gpus = f" or cuda[:i] (i < {torch.cuda.device_count()})" if torch.cuda.is_available() else ""
        raise BadInput(f"{name!r} is not a device this machine has ({' '.join(str(exc).split())[:160]}); expected "
                       f"cpu{gpus}", field="--device") from None
    return dev


#: the most --speculative-num-steps the simulation takes
MAX_STEPS = 64


def cli_main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m helpers simulate ...`` (module docstring)."""
    prog = "simulate"

    def body() -> int:
        a = build_parser().parse_args(list(argv) if argv is not None else None)
        if a.samples < 1:
            raise BadInput("--samples must be >= 1", field="--samples")
        if a.steps > MAX_STEPS:
            raise BadInput(f"--steps {a.steps}: expected at most {MAX_STEPS} (the simulation grows with the steps; "
                           "EAGLE-3 trainers train 7-8 TTT steps)", field="--steps")
        st = DraftSettings(a.steps, a.topk, a.draft_tokens if a.draft_tokens is not None else
                           default_draft_tokens(a.steps, a.topk)).check()
        device = _device(a.device)
        show = progress_line(prog)
        draft_dir, target_dir = Path(a.draft), Path(a.target)
        DraftArch.from_config(draft_dir)                                # the draft is checked before its log
        log_path = find_training_log(draft_dir, a.training_log)        # bad input is found before any work
        log = read_training_log(log_path) if log_path is not None else None
        choice = choose_dtype(server_dtype({}, read_draft_config(draft_dir).raw), device,
                              requested=None if a.dtype == "auto" else DTYPE_NAMES[a.dtype],
                              server_note="the draft config's torch_dtype, as SGLang's --dtype auto")
        show(f"compute dtype {choice.reason}")
        H = read_target_config(target_dir).hidden_size
        off = offline_inputs(draft_dir, target_dir, a.training, hidden_size=H, choice=choice, samples=a.samples,
                             served=a.served, training_log=log_path, log=log, validation=a.validation,
                             rows_word=rows_arg(a.rows), device=device, draft_cost=a.draft_cost, progress=show)
        findings = draft_checks(draft_dir, target_dir, training=Path(a.training))
        if len(off.training) < a.samples:
            show(f"--samples {a.samples}: the training data give {len(off.training)} usable sample(s); all are used")
        show(f"simulating {len(off.training)} training sample(s)"
             + (f" and {len(off.served)} served" if off.served else "") + f" at {st.label} ...")
        required = ("draft", "settings") + (("wiring",) if off.served else ())
        b = acceptance_budget(off.draft, off.budget_inputs(st), required=required)
        b["draft_findings"] = findings
        code = 0 if b["cause"] == "none" else 1
        if a.json:
            print(json.dumps(b, indent=1))
            return code
        for s in b["stages"]:
            ci = s.get("ci") or [None, None]
            ci_txt = f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci[0] is not None and ci[1] is not None else ""
            pos = ", ".join(f"{x:.2f}" for x in (s.get("p_accept_ge") or []))
            al = "n/a" if s.get("accept_length") is None else f"{s['accept_length']:.2f}"
            print(f"{s['name']:<28} accept length {al}{ci_txt}"
                  + (f"  P(accepted >= j) [{pos}]" if pos else "") + f"  ({s.get('source', '')})")
            for row in s.get("table") or []:
                print(f"  TTT step {row['step']}: acc {row['acc']:.3f} [{row['acc_ci'][0]:.3f}, "
                      f"{row['acc_ci'][1]:.3f}] vs log {row['log_acc']:.3f}"
                      + (f"; loss {row['loss']:.3f} vs log {row['log_loss']:.3f}"
                         if row.get("loss") is not None and row.get("log_loss") is not None else ""))
            if s.get("why") and s["name"] == "checkpoint (teacher-forced)":
                print(f"  rows: {s['why']}")
        for t in b["settings_table"]:
            print(f"  steps {t['steps']} topk {t['topk']} draft tokens {t['draft_tokens']}: accept length "
                  f"{t['accept_length']:.2f}")
        for f in findings:
            print(f"draft check: {f['kind']}: {f['detail']}")
        print(f"compute dtype {choice.reason}")
        print(b["sentence"])
        return code

    return run(prog, body)
