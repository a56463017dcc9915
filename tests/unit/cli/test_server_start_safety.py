"""``server start`` (issue 40): its own flags checked before any server starts (``--tp 0``, ``--steps 0``, ``--dtype
bogus``, ``--timeout nan`` / ``-5``: one line naming the flag, exit 2, no process launched), and ``--state-file PATH``
never deleting nor overwriting a file the user has (PATH, or with ``--detach`` its ``.out`` sibling), even when the
start then fails."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from helpers.__main__ import main
from helpers.server import process as server_process

from support import ROOT


@pytest.fixture
def no_launch(monkeypatch):
    """Every way a server (or the detached supervisor) is launched fails the test."""
    calls = []

    def refuse(*a, **k):
        calls.append(a)
        raise AssertionError(f"a process was launched: {a[:1]}")

    monkeypatch.setattr(server_process.ServerProcess, "launch_healthy", classmethod(refuse))
    monkeypatch.setattr(subprocess, "Popen", refuse)
    return calls


def _target(tmp_path):
    t = tmp_path / "target"
    t.mkdir(parents=True)
    (t / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                                               "hidden_size": 64, "num_attention_heads": 1,
                                               "num_key_value_heads": 1, "num_hidden_layers": 2}))
    return t


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
@pytest.mark.parametrize("flags,named", [(["--tp", "0"], "--tp must be at least 1, got 0"),
                                         (["--steps", "0"], "--steps must be at least 1, got 0"),
                                         # issue 40: the upper bounds of the tool's own /server_info check
                                         (["--tp", "100000"], "--tp must be at most 1024, got 100000"),
                                         (["--steps", "100000"], "--steps must be at most 64, got 100000"),
                                         (["--topk", "65"], "--topk must be at most 64, got 65"),
                                         (["--draft-tokens", "99999999"],
                                          "--draft-tokens must be at most 1024, got 99999999"),
                                         (["--dtype", "bogus"], "--dtype 'bogus' is not one"),
                                         (["--timeout", "nan"], "--timeout must be a finite number"),
                                         (["--timeout", "-5"], "--timeout must be a finite number"),
                                         (["--timeout", "inf"], "--timeout must be a finite number"),
                                         (["--port", "99999"], "--port: expected ports within 1-65535")])
def test_flags_are_checked_before_any_server_starts(engine, flags, named, tmp_path, capsys, no_launch):
    if engine == "vllm" and flags[0] in ("--draft-tokens", "--topk"):       # vLLM takes neither at all
        named = f"--engine vllm: {flags[0]} apply to SGLang only"
    for detach in ([], ["--detach"]):
        rc = main(["server", "start", "--engine", engine, "--target", str(_target(tmp_path / engine / str(len(detach)))),
                   *detach, *flags])
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 2 and len(err) == 1 and err[0].startswith(f"server: error: {named}"), (rc, err)
    assert no_launch == []


@pytest.mark.parametrize("flag", ["--trace-draft", "--capture-ranks", "--capture-layers"])
def test_a_hook_folder_is_made_before_the_start_or_refused_in_one_line(flag, tmp_path, capsys, no_launch,
                                                                       monkeypatch):
    """The hook folders are made (absolute) before any server starts: a trace folder that did not exist yet made the
    trace probes say "not readable on this machine" on a server started with it; a file in its place is refused."""
    target = _target(tmp_path)
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    draft = ["--reference-draft"] if flag == "--trace-draft" else []
    rc = main(["server", "start", "--target", str(target), *draft, flag, str(blocker)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith(f"server: error: {flag} {blocker}: not a folder"), err
    rc = main(["server", "start", "--target", str(target), *draft, flag, str(blocker / "below")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and flag in err[0], err
    monkeypatch.chdir(tmp_path)
    main(["server", "start", "--target", str(target), *draft, flag, "new/nested"])   # the launch is refused here
    capsys.readouterr()
    assert (tmp_path / "new" / "nested").is_dir()
    assert len(no_launch) == 1 and str(tmp_path / "new" / "nested") in json.dumps(no_launch, default=str)


def test_a_hook_folder_behind_a_symlink_loop_a_file_parent_or_not_utf8_is_named_so(tmp_path, capsys, no_launch):
    """Breaker item 15: a symlink loop and a path under a file both said "a file of that name exists"; a path that
    is not UTF-8 was taken (the run's JSON cannot hold it)."""
    target = _target(tmp_path)
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    (tmp_path / "afile").write_text("x")
    for path, says in ((tmp_path / "loop", f"not a folder: {tmp_path / 'loop'} is a symlink loop"),
                       (tmp_path / "loop" / "sub", f"not a folder: {tmp_path / 'loop'} is a symlink loop"),
                       (tmp_path / "afile" / "sub", f"not a folder: its parent {tmp_path / 'afile'} is a file"),
                       (str(tmp_path / "bad") + "\udcff", "is not valid UTF-8")):
        rc = main(["server", "start", "--target", str(target), "--trace-draft", str(path)])
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 2 and len(err) == 1 and err[0].startswith("server: error: --trace-draft ") and says in err[0], err
        assert "a file of that name exists" not in err[0]
    assert not (tmp_path / "bad\udcff").exists() and no_launch == []


def test_vllm_tp_0_no_longer_divides_by_zero(tmp_path, capsys, no_launch):
    assert main(["server", "start", "--engine", "vllm", "--target", str(_target(tmp_path)), "--tp", "0"]) == 2
    assert "ZeroDivisionError" not in capsys.readouterr().err


def _start(tmp_path, *args, timeout=120):
    return subprocess.run([sys.executable, "-m", "helpers", "server", "start", "--detach", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def test_an_existing_state_file_or_its_out_sibling_is_never_touched(tmp_path):
    state, out = tmp_path / "state.json", tmp_path / "state.out"
    state.write_bytes(b"my notes\x00\xff")
    r = _start(tmp_path, "--state-file", str(state), "--target", str(tmp_path / "none"))
    assert r.returncode == 2 and r.stderr.strip() == (
        f"server: error: {state} exists (--state-file): a state file and its output are never overwritten nor "
        "deleted; remove it (a server it names is stopped with `server stop PID`) or pick another --state-file")
    assert state.read_bytes() == b"my notes\x00\xff" and not out.exists()
    state.unlink()
    out.write_text("my other notes")
    r = _start(tmp_path, "--state-file", str(state), "--target", str(tmp_path / "none"))
    assert r.returncode == 2 and f"{out} exists (the output file of --detach)" in r.stderr, r.stderr
    assert out.read_text() == "my other notes" and not state.exists()
    # the foreground start refuses an existing state file too (it would write over it once healthy)
    state.write_text("{}")
    r = subprocess.run([sys.executable, "-m", "helpers", "server", "start", "--state-file", str(state)], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and f"{state} exists (--state-file)" in r.stderr and state.read_text() == "{}"
    r = _start(tmp_path, "--state-file", str(tmp_path / "x.out"))
    assert r.returncode == 2 and "a name ending in .out" in r.stderr and not (tmp_path / "x.out").exists()


def test_a_start_that_fails_leaves_its_output_and_no_state_file(tmp_path):
    """The background start fails (no config.json in the target): the error names the output file, which is kept
    (nothing of the user's was there); no state file is written; the next start with the same PATH is refused
    rather than overwriting that output."""
    (tmp_path / "empty").mkdir()
    state = tmp_path / "s.json"
    r = _start(tmp_path, "--state-file", str(state), "--target", str(tmp_path / "empty"))
    assert r.returncode == 2 and f"(output: {tmp_path / 's.out'})" in r.stderr, r.stderr
    assert not state.exists() and "config.json" in (tmp_path / "s.out").read_text()
    before = (tmp_path / "s.out").read_bytes()
    r = _start(tmp_path, "--state-file", str(state), "--target", str(tmp_path / "empty"))
    assert r.returncode == 2 and "s.out exists" in r.stderr and (tmp_path / "s.out").read_bytes() == before


def test_a_trace_without_a_draft_is_refused(tmp_path, capsys, no_launch):
    """``--trace-draft`` on a server without a draft traced nothing and the probes then blamed ``--draft`` (the
    fresh-user run): refused in one line before any start."""
    rc = main(["server", "start", "--target", str(_target(tmp_path)), "--trace-draft", str(tmp_path / "t")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "give the draft too" in err[0] and no_launch == []


def test_a_trace_of_a_nextn_head_needs_no_draft(tmp_path, capsys, no_launch):
    """``--nextn`` serves the target's own NextN layer as the draft: ``--trace-draft`` is taken without ``--draft``
    (the launch is reached, carrying the trace hook with no d2t folder: the head drafts in the target's vocabulary)."""
    rc = main(["server", "start", "--target", str(ROOT / "env" / "models" / "kimi" / "target"), "--nextn",
               "--trace-draft", str(tmp_path / "t")])
    capsys.readouterr()
    assert rc != 0 and len(no_launch) == 1, no_launch              # the launch itself is refused by the fixture
    launched = json.dumps(no_launch, default=str)
    assert "helpers.trace_hooks:draft_trace_factory" in launched and str(tmp_path / "t") in launched, launched
    assert "NEXTN" in launched


@pytest.mark.parametrize("faults,named", [
    ('[{"kind": "wrong_layer"}]', "--faults: item 0: fault 'wrong_layer' needs field(s) ['chunk', 'layer']"),
    ('[{"kind": "bogus", "chunk": 0}]', "--faults: item 0: unknown fault kind 'bogus'"),
    ('[{"kind": "wrong_layer", "chunk": 0, "layer": 7, "lyer": 7}]', "--faults: item 0: unknown field(s) ['lyer']"),
    ('{"kind": "wrong_layer"}', "--faults: expected a JSON list of fault objects, got dict"),
    ('[7]', "--faults: item 0: expected an object with a 'kind', got int"),
    ("[{kind: wrong_layer}]", "--faults: not JSON"),
    pytest.param("[" * 100000, "--faults: not JSON", id="nested-100000-deep")])
def test_bad_faults_are_refused_before_any_server_starts(faults, named, tmp_path, capsys, no_launch):
    """A bad ``--faults`` was found only by the detached supervisor, once started, and its message came back doubled
    ("the background server exited (2): server: error: fault ..."): now one line, exit 2, nothing launched."""
    for detach in ([], ["--detach"]):
        rc = main(["server", "start", "--target", str(_target(tmp_path / str(len(detach)))), *detach,
                   "--faults", faults])
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 2 and len(err) == 1 and err[0].startswith(f"server: error: {named}"), (rc, err)
        assert "background server" not in err[0]
    assert no_launch == []


def test_the_documented_faults_parse():
    """docs/mtp.md's ``--faults`` values are what ``server start --faults`` takes (helpers.faults.parse_faults)."""
    from helpers.faults import parse_faults
    emb, = parse_faults('[{"kind":"embedding_in_place_of_layer","chunk":0}]')
    wl, = parse_faults('[{"kind":"wrong_layer","chunk":0,"layer":7}]')
    assert (emb.kind, emb.chunk, emb.stash_keys()) == ("embedding_in_place_of_layer", 0, ["embedding"])
    assert (wl.kind, wl.chunk, wl.layer, wl.stash_keys()) == ("wrong_layer", 0, 7, ["out(7)"])
