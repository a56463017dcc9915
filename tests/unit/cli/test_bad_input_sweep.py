"""A generated bad-input sweep (issue 40, extended tier): seeded random malformed inputs for the file-taking flags of
diagnose, simulate, measure, capture and investigate (against a fake SGLang server on 127.0.0.1), each case made by
the test: wrong types and shapes, random bytes of random sizes, encodings (Latin-1, UTF-16), JSON that nests too deep
or holds a 5000-digit integer or NaN, truncated and lying safetensors headers, pickled objects, files over their size
limit, and special files (a FIFO with no writer, /dev/zero, a socket-less symlink loop, a dangling symlink, a folder
given for a file). Every case must end with exit 2 (or 1 where the server is what fails) and exactly one line on
stderr, ``<command>: error: ...``, naming the flag or the file, with no traceback; a case that blocks fails after
``CASE_TIMEOUT_S`` instead of hanging the suite.

``E3F_SWEEP_SEED`` picks another draw (default 0: random sizes, contents, suffixes, file-or-folder); ``E3F_SWEEP_KINDS``
how many kinds per flag (default all 17: 238 cases, ~3 s here, every error being found before any work). A failing case prints its seed, flag and kind to replay it."""
from __future__ import annotations

import json
import os
import pickle
import shutil
import signal
import struct
from pathlib import Path

import numpy as np
import pytest

from helpers.__main__ import main
from support.fakeserver import fake_server, free_port

pytestmark = pytest.mark.extended

SEED = int(os.environ.get("E3F_SWEEP_SEED", "0"))
KINDS_PER_FLAG = int(os.environ.get("E3F_SWEEP_KINDS", "17"))
CASE_TIMEOUT_S = 30
REPO = Path(__file__).resolve().parents[3]
MODELS = REPO / "env" / "models"

#: the file names a flag's reader tells apart by suffix (a prompt file: .json is a list, else JSON lines)
SUFFIXES = {"--prompts": (".json", ".jsonl", ""), "--fixes": (".yaml", ".yml"), "--training-log": (".json", ".jsonl", ".txt"),
            "--served": (".json", ""), "--requests": (".jsonl", ""), "--draft-config": (".json", ""), "--reference": ("",)}

#: what a malformed input can be (each a function of the rng and the path it is made at)
KINDS = ("fifo", "devzero", "loop", "dangling", "folder", "empty", "random", "latin1", "utf16", "wrongtype",
         "deep", "bigint", "nan", "st_truncated", "st_header", "pickle", "oversize")


def make(kind: str, path: Path, rng: np.random.Generator) -> None:
    """Make the malformed input ``kind`` at ``path`` (a file, or what stands where a file should be)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "devzero":
        path.symlink_to("/dev/zero")
    elif kind == "loop":
        path.symlink_to(path)
    elif kind == "dangling":
        path.symlink_to(path.parent / "no-such-file")
    elif kind == "folder":
        path.mkdir()
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "random":
        path.write_bytes(rng.bytes(int(rng.integers(1, 1 << int(rng.integers(1, 17))))))
    elif kind == "latin1":
        path.write_bytes(b'{"name": "caf\xe9", "x": "\xff\xfe"}')
    elif kind == "utf16":
        path.write_bytes(json.dumps({"hidden_size": 64, "input_ids": [1, 2]}).encode("utf-16"))
    elif kind == "wrongtype":
        path.write_text(str(rng.choice(['[]', '42', '"text"', 'null', 'true', '{"hidden_size": "sixty-four"}',
                                        '{"input_ids": {"a": 1}}', '[[1, 2.5], ["x"]]', '{"architectures": 5}'])))
    elif kind == "deep":
        n = int(rng.integers(150, 20000))
        path.write_text("[" * n + "]" * n)
    elif kind == "bigint":
        path.write_text('{"hidden_size": ' + "9" * int(rng.integers(4400, 6000)) + "}")
    elif kind == "nan":
        path.write_text('{"hidden_size": NaN, "num_hidden_layers": Infinity, "input_ids": [-Infinity]}')
    elif kind == "st_truncated":
        header = json.dumps({"hidden_states": {"dtype": "F32", "shape": [5, 3, 64], "data_offsets": [0, 3840]}})
        path.write_bytes(struct.pack("<Q", len(header)) + header.encode() + rng.bytes(int(rng.integers(0, 100))))
    elif kind == "st_header":
        path.write_bytes(struct.pack("<Q", int(rng.choice([2 ** 60, 2 ** 33, 7]))) + b'{"x": ')
    elif kind == "pickle":
        path.write_bytes(pickle.dumps({"input_ids": print}))      # a global: refused unexecuted (weights_only)
    elif kind == "oversize":
        with open(path, "wb") as f:                               # 65 MiB: over every JSON / YAML / config limit
            f.truncate(65 * 2 ** 20)
    else:  # pragma: no cover
        raise ValueError(kind)


def _folder_with(src: Path, dst: Path, name: str, kind: str, rng) -> Path:
    """``dst``: a copy (symlinks) of the folder ``src`` whose file ``name`` is the malformed input."""
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.name != name:
            (dst / f.name).symlink_to(f.resolve())
    make(kind, dst / name, rng)
    return dst


class Hung(Exception):
    pass


def _run(argv: list[str], capsys) -> tuple[int, list[str]]:
    def boom(*_):
        raise Hung(f"{argv[0]} blocked for {CASE_TIMEOUT_S} s")
    old = signal.signal(signal.SIGALRM, boom)
    signal.alarm(CASE_TIMEOUT_S)
    try:
        rc = main(argv)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    err = [ln for ln in capsys.readouterr().err.splitlines()
           if ln.strip() and not ln.startswith(f"[{argv[0]}]") and not ln.startswith("warning:")]
    return rc, err


def _served_dump(train: Path, out: Path) -> Path:
    """A served dump of the first training sample's own rows (a valid ``--served`` beside the malformed one)."""
    from helpers.formats.dumps import write_dump
    from helpers.formats.training_data import TrainingData
    if out.exists():
        return out
    s = next(iter(TrainingData(train, max_samples=1)))
    return write_dump(out, [{"key": s.key, "input_ids": s.input_ids, "hidden": s.load()}],
                      {"kind": "served", "hidden_size": int(s.meta["hidden_size"])})


def _cases(tmp: Path):
    """``(command, flag, argv builder, file name in a folder or None)`` for every file-taking flag swept.
    An argv builder takes the malformed path (a file, or a folder holding the malformed file) and the fake URL."""
    train, draft, target = MODELS / "data" / "sample", MODELS / "draft", MODELS / "target"
    sample_file = sorted(train.glob("*"))[0].name
    closed = f"http://127.0.0.1:{free_port()}"
    served = _served_dump(train, tmp / "served")
    return [
        ("diagnose", "--served", lambda p, u: ["diagnose", "--training", str(train), "--served", str(p)],
         ("folder", served, "manifest.json")),
        ("diagnose", "--training", lambda p, u: ["diagnose", "--training", str(p), "--served", str(served)],
         ("folder", train, sample_file)),
        ("diagnose", "--draft-config", lambda p, u: ["diagnose", "--draft-config", str(p), "--target-config",
                                                     str(target)], None),
        ("diagnose", "--target-config", lambda p, u: ["diagnose", "--draft-config", str(draft),
                                                      "--target-config", str(p)], ("folder", target, "config.json")),
        ("diagnose", "--reference", lambda p, u: ["diagnose", "--training", str(train), "--served", str(served),
                                                  "--reference", str(p)], ("folder", served, "tensors.safetensors")),
        ("simulate", "--draft", lambda p, u: ["simulate", "--draft", str(p), "--target", str(target), "--training",
                                              str(train)], ("folder", draft, "model.safetensors")),
        ("simulate", "--target", lambda p, u: ["simulate", "--draft", str(draft), "--target", str(p), "--training",
                                               str(train)], ("folder", target, "config.json")),
        ("simulate", "--training-log", lambda p, u: ["simulate", "--draft", str(draft), "--target", str(target),
                                                     "--training", str(train), "--training-log", str(p)], None),
        ("measure", "--prompts", lambda p, u: ["measure", "--url", closed, "--prompts", str(p), "--no-save",
                                               "--quiet"], None),
        ("measure", "--requests", lambda p, u: ["measure", "--url", closed, "--requests", str(p), "--no-save",
                                                "--quiet"], None),
        ("investigate", "--requests", lambda p, u: ["investigate", "--url", u, "--training", str(train), "--target",
                                                    str(target), "--draft", str(draft), "--requests", str(p),
                                                    "--no-apply", "--no-budget", "--out", str(tmp / "outputs"),
                                                    "--timeout", "60"], None),
        ("measure", "--fixes", lambda p, u: ["measure", "--fixes", str(p), "--outputs", str(tmp / "outputs")], None),
        ("capture", "--training", lambda p, u: ["capture", "--url", closed, "--training", str(p), "--num-samples",
                                                "1"], ("folder", train, sample_file)),
        ("investigate", "--training", lambda p, u: ["investigate", "--url", u, "--training", str(p), "--target",
                                                    str(target), "--draft", str(draft), "--no-apply", "--no-budget",
                                                    "--out", str(tmp / "outputs"), "--timeout", "60"],
         ("folder", train, sample_file)),
        ("investigate", "--target", lambda p, u: ["investigate", "--url", u, "--training", str(train), "--target",
                                                  str(p), "--draft", str(draft), "--no-apply", "--no-budget",
                                                  "--out", str(tmp / "outputs"), "--timeout", "60"],
         ("folder", target, "config.json")),
        ("investigate", "--draft", lambda p, u: ["investigate", "--url", u, "--training", str(train), "--target",
                                                 str(target), "--draft", str(p), "--no-apply", "--no-budget",
                                                 "--out", str(tmp / "outputs"), "--timeout", "60"],
         ("folder", draft, "config.json")),
    ]


def test_generated_bad_inputs_exit_2_with_one_line_naming_the_flag_or_file(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("E3F_OUTPUTS", str(tmp_path / "outputs"))
    (tmp_path / "outputs").mkdir()
    rng = np.random.default_rng(SEED)
    failures, ran = [], 0
    with fake_server("ok") as url:
        for k, (cmd, flag, argv_of, folder) in enumerate(_cases(tmp_path)):
            kinds = rng.choice(KINDS, size=min(KINDS_PER_FLAG, len(KINDS)), replace=False)
            for kind in kinds:
                where = tmp_path / f"c{k}-{kind}"
                if folder is not None and kind not in ("fifo", "devzero", "loop", "dangling") and rng.random() < 0.7:
                    path = _folder_with(folder[1], where, folder[2], str(kind), rng)     # the file inside
                    named = (str(path), flag)
                else:
                    path = where / ("input" + str(rng.choice(SUFFIXES.get(flag, ("",)))))
                    make(str(kind), path, rng)
                    named = (str(path), flag)
                argv = argv_of(path, url)
                try:
                    rc, err = _run(argv, capsys)
                except Hung as exc:
                    failures.append(f"seed {SEED} {cmd} {flag} {kind}: {exc}")
                    continue
                ran += 1
                line = err[0] if err else ""
                ok_rc = rc == 2 or (rc == 1 and cmd == "investigate" and "server" in line.lower())
                problems = []
                if not ok_rc:
                    problems.append(f"exit {rc}")
                if len(err) != 1 or not line.startswith(f"{cmd}: error: "):
                    problems.append(f"{len(err)} stderr lines: {err[:3]}")
                if "Traceback" in line or "Error:" in line.split("error:", 1)[-1]:
                    problems.append("a traceback or an exception type")
                if not any(n in line for n in named):
                    problems.append("names neither the flag nor the file")
                if problems:
                    failures.append(f"seed {SEED} {cmd} {flag} {kind} ({path}): {'; '.join(problems)}: {line[:300]}")
    print(f"bad-input sweep: seed {SEED}, {ran} cases run, {len(failures)} failed")
    assert ran >= len(_cases(tmp_path)) * min(KINDS_PER_FLAG, len(KINDS)) - len(failures)
    assert not failures, "\n".join(failures)


def test_the_sweep_makes_every_kind_it_names(tmp_path):
    """Each kind is what it says (so a passing sweep is not one of empty files)."""
    rng = np.random.default_rng(SEED)
    for kind in KINDS:
        p = tmp_path / kind
        make(kind, p, rng)
        if kind == "fifo":
            assert p.is_fifo()
        elif kind in ("loop", "dangling"):
            assert p.is_symlink() and not p.exists()
        elif kind == "devzero":
            assert p.resolve() == Path("/dev/zero") and p.is_char_device()
        elif kind == "folder":
            assert p.is_dir()
        elif kind == "oversize":
            assert p.stat().st_size > 64 * 2 ** 20
        elif kind == "bigint":
            assert len(p.read_text()) > 4300
        elif kind != "empty":
            assert p.stat().st_size > 0
    shutil.rmtree(tmp_path / "folder")
