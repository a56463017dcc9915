"""``python -m helpers replay CASE.yaml``: replay a case file into a new run folder; a recorded case
(:class:`helpers.investigation.cases.RecordedCase`, a ``recording:`` field) is read back offline, or recorded again
with ``--record``."""
from __future__ import annotations

import os
import sys

from ..acceptance.sweeps import steps_sweep_verdict
from ..investigation.cases import load_case
from ..investigation.replay import replay_case
from ..runfiles import new_run_dir
from .common import Parser, failure_guard, out_folder
from .common import run as run_cli


def cli_main(argv: list[str]) -> int:
    """``python -m helpers replay CASE.yaml [--out DIR] [--quiet]``: replay a case into a new run
    folder ``<DIR>/<YYYYmmdd-HHMMSS>-<case>`` (default ``outputs/``) and print its headline and one
    line per step. The API key, if the case's servers need one, is read from ``$SGLANG_API_KEY``.

    A recorded case (a ``recording:`` field, :mod:`helpers.investigation.recorded`) starts nothing: its recorded
    investigation is read back and its headline printed; ``--record`` starts its server, investigates it and writes
    the recording again.

    Exit status: 0 when the replay completed and every hypothesis got its expected verdict (a recorded case: its
    recording was read, or written), 1 otherwise, 2 for an invalid case file or recording (the field is named)."""

    return run_cli("replay", lambda: _body(argv))


def _body(argv: list[str]) -> int:
    ap = Parser(prog="python -m helpers replay", description="Replay a case file into a new run folder.")
    ap.add_argument("case", help="case file (YAML), e.g. env/cases/seeds_hunt.yaml")
    ap.add_argument("--out", default=None, help="folder receiving the run folder (default: outputs/)")
    ap.add_argument("--quiet", action="store_true", help="no progress bars")
    ap.add_argument("--record", action="store_true",
                    help="a recorded case (a 'recording:' field): start its server and record its investigation again")
    a = ap.parse_args(argv)
    if a.record or _is_recorded(a.case):
        return _recorded(a)
    case = load_case(a.case)
    run = new_run_dir(case.name, out_folder(a.out, "--out"))
    print(f"[replay] {case.name} -> {run}", file=sys.stderr)
    with failure_guard("replay", run):
        doc = replay_case(case, run, progress=not a.quiet, api_key=os.environ.get("SGLANG_API_KEY") or None)
    ok = doc.complete
    for s in doc.steps:
        if s.kind == "hypothesis":
            flag = "" if s.as_expected in (None, True) else f"  (expected {s.expect})"
            ok &= s.as_expected in (None, True)
            print(f"  step {s.index + 1}: {s.check}: {s.verdict}{flag}")
        elif s.kind == "investigate":
            print(f"  step {s.index + 1}: investigation: {s.verdict}: {s.sentence}")
        elif s.kind == "fix":
            summ = s.summary or {}
            what = (f"accept length {summ['accept_length']:.2f}, accept rate {100 * summ['accept_rate']:.0f}%"
                    if summ.get("accept_length") is not None else (s.error or s.server_error or "server did not start"))
            print(f"  step {s.index + 1}: fix '{s.name}': {what}")
        elif s.kind == "sweep":
            v = steps_sweep_verdict(s.points or [])
            print(f"  step {s.index + 1}: sweep: {v['text'] if v else 'no point measured'}")
    print(doc.headline)
    print(f"[replay] results: {run / 'results'}", file=sys.stderr)
    return 0 if ok else 1


def _is_recorded(path: str) -> bool:
    """Whether a case file is a recorded case (a top-level ``recording:`` field); a file that cannot be read is left
    to :func:`load_case`'s message."""
    try:
        from ..runfiles import load_yaml_text, read_file_text  # lazy: the CLI parser imports nothing heavy
        data = load_yaml_text(read_file_text(path, "case file", expected="YAML"), "case file", path=path)
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and "recording" in data


def _recorded(a) -> int:
    from ..investigation.recorded import record_case, recorded_headline, replay_recorded  # lazy: recorded cases
    if a.record:
        folder = record_case(a.case, progress=lambda s: print(f"[record] {s}", file=sys.stderr))
        print(f"[record] recording: {folder}", file=sys.stderr)
    doc, meta = replay_recorded(a.case)
    print(recorded_headline(doc, meta))
    print(doc.sentence)
    return 0
