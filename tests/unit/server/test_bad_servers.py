"""Reliability against misbehaving servers and repeated runs (issues 13 and 21), with small fake servers on 127.0.0.1
(tests/support/fakeserver.py, stopped by PID): overall deadlines, size limits, malformed answers, a server dying
mid-run, repeated labels, a full disk; keyed servers and relaunch commands (no key in any file), YAML alias bombs,
deep JSON, absurd or malformed /server_info, redirects, impossible spec counters, escape sequences. Every failure is
one line ``<command>: error: ...`` with exit 1 (server or run failure) or 2 (bad input), within seconds."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from helpers.__main__ import main
from support import ROOT
from support.fakerun import write_training
from support.fakeserver import H, fake_server


@pytest.fixture(scope="module")
def training(tmp_path_factory) -> Path:
    """A 3-chunk, 16-wide training dump of two samples (the fake server's width)."""
    return write_training(tmp_path_factory.mktemp("train") / "train")


def _one_line_error(capsys, prog: str) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    errors = [ln for ln in err if ln.startswith(f"{prog}: error:")]
    assert len(errors) == 1, err
    assert "Traceback" not in "\n".join(err)
    return errors[0]


@pytest.mark.parametrize("mode", ["hang", "trickle"])
def test_capture_deadline_on_a_hanging_or_trickling_server(mode, training, tmp_path, capsys):
    with fake_server(mode) as url:
        t = time.monotonic()
        rc = main(["capture", "--url", url, "--training", str(training), "--run-dir", str(tmp_path),
                   "--num-samples", "1", "--timeout", "3"])
        took = time.monotonic() - t
    line = _one_line_error(capsys, "capture")
    assert rc == 1 and took < 20, (rc, took)
    assert "/generate" in line and url in line and "deadline of 3 s" in line and "elapsed" in line, line
    assert not (tmp_path / "dumps" / "served").exists()


def test_progress_lines_while_waiting(training, tmp_path, capsys):
    from helpers.server.client import SGLangClient

    lines = []
    with fake_server("hang") as url:
        c = SGLangClient(url, deadline_s=2.5, on_wait=lines.append, wait_every=0.5)
        with pytest.raises(Exception, match="deadline"):
            c.generate(input_ids=[1, 2], max_new_tokens=1)
        c.close()
    assert len(lines) >= 3 and all("still waiting for POST" in ln and "/generate" in ln for ln in lines), lines


def test_oversize_server_info_and_hidden_width(training, tmp_path, capsys):
    with fake_server("oversize") as url:
        rc = main(["capture", "--url", url, "--training", str(training), "--run-dir", str(tmp_path),
                   "--num-samples", "1", "--timeout", "60"])
        line = _one_line_error(capsys, "capture")
        assert rc == 1 and "/server_info" in line and "over the limit of 8.0 MiB" in line, line
        from helpers.capture import capture_served
        from helpers.errors import SGLangError
        from helpers.server.client import SGLangClient

        c = SGLangClient(url, max_info_bytes=64 << 20)
        with pytest.raises(SGLangError, match="200000 wide, over the limit of 256"):
            capture_served(c, [[1, 2, 3]], tmp_path / "dumps", name="wide", max_width=16 * H, progress=False)
        c.close()
    assert not (tmp_path / "dumps" / "wide").exists()


def test_malformed_generate_answers_name_the_endpoint_and_field(training, tmp_path, capsys):
    with fake_server("malformed") as url:
        rc = main(["capture", "--url", url, "--training", str(training), "--run-dir", str(tmp_path),
                   "--num-samples", "2", "--timeout", "30"])
        line = _one_line_error(capsys, "capture")
        assert rc == 1 and "/generate" in line and ("meta_info" in line or "field" in line), line
        rc = main(["measure", "--url", url, "--num-prompts", "4", "--max-new-tokens", "4", "--outputs",
                   str(tmp_path / "m"), "--quiet", "--timeout", "30"])
    line = _one_line_error(capsys, "measure")
    assert rc == 1 and "requests failed" in line, line


def test_measure_exits_1_when_the_server_dies_mid_run(tmp_path, capsys):
    with fake_server("die") as url:
        rc = main(["measure", "--url", url, "--num-prompts", "6", "--max-new-tokens", "4", "--warmup", "0",
                   "--no-flush", "--outputs", str(tmp_path), "--quiet", "--timeout", "60"])
    line = _one_line_error(capsys, "measure")
    assert rc == 1 and "of 6 requests failed" in line, line
    (summary,) = list(tmp_path.glob("*/fixes/server/summary.json"))
    assert json.loads(summary.read_text())["summary"]["n_failed"] >= 3


def test_repeated_labels_never_overwrite_a_measurement(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    with fake_server("ok") as url:
        args = ["measure", "--url", url, "--num-prompts", "3", "--max-new-tokens", "4", "--label", "same",
                "--run-dir", str(run), "--quiet", "--timeout", "60", "--warmup", "0"]
        assert main(args) == 0
        assert main(args) == 0
        # two at once, as separate processes
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        procs = [subprocess.Popen([sys.executable, "-m", "helpers", *args], cwd=ROOT, env=env,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for _ in range(2)]
        assert [p.wait(timeout=180) for p in procs] == [0, 0], [p.stderr.read() for p in procs]
    folders = sorted(p.name for p in (run / "fixes").iterdir())
    assert folders == ["same", "same-2", "same-3", "same-4"], folders
    for f in folders:
        assert sorted(x.name for x in (run / "fixes" / f).iterdir()) == ["per_request.parquet", "positions.csv",
                                                                          "summary.json"]
    ledger = pd.read_parquet(run / "ledger.parquet")
    assert sorted(ledger["saved_to"]) == [f"fixes/{f}" for f in folders]


def test_an_unreadable_ledger_keeps_the_new_measurement_and_is_rebuilt(tmp_path, capsys):
    """Issue 30: a run folder whose ledger.parquet was truncated (a full disk, an editor): `measure --run-dir` keeps
    the new measurement, leaves the ledger as it was, and says so in one line naming the file, what was expected and
    the command that rebuilds it (exit 2, no debug suffix); that command rebuilds the ledger from fixes/ with the
    old row as it was, and keeps the corrupt file beside it."""
    run = tmp_path / "run"
    run.mkdir()
    with fake_server("ok") as url:
        args = ["measure", "--url", url, "--num-prompts", "3", "--max-new-tokens", "4", "--run-dir", str(run),
                "--quiet", "--timeout", "60", "--warmup", "0"]
        assert main(args + ["--label", "a"]) == 0
        capsys.readouterr()
        before = pd.read_parquet(run / "ledger.parquet")
        data = (run / "ledger.parquet").read_bytes()
        (run / "ledger.parquet").write_bytes(data[:len(data) // 2])       # truncated as by a full disk
        rc = main(args + ["--label", "x"])
    line = _one_line_error(capsys, "measure")
    assert rc == 2 and "E3F_DEBUG" not in line and "LedgerError" not in line, line
    assert f"{run / 'ledger.parquet'}: the ledger cannot be read" in line and "expected the Parquet table" in line
    assert f"kept in fixes/x" in line and f"python -m helpers measure --rebuild-ledger {run}" in line, line
    assert (run / "ledger.parquet").read_bytes() == data[:len(data) // 2]
    assert json.loads((run / "fixes" / "x" / "summary.json").read_text())["summary"]["label"] == "x"

    assert main(["measure", "--rebuild-ledger", str(run)]) == 0
    out = capsys.readouterr().out
    (kept,) = run.glob("ledger.parquet.corrupt-*")
    assert kept.read_bytes() == data[:len(data) // 2] and kept.name in out and "2 row(s)" in out, out
    after = pd.read_parquet(run / "ledger.parquet")
    assert list(after["saved_to"]) == ["fixes/a", "fixes/x"] and list(after["fix"]) == ["a", "x"]
    pd.testing.assert_frame_equal(after.iloc[:1][before.columns], before)       # the old row, value for value
    x = json.loads((run / "fixes" / "x" / "summary.json").read_text())
    assert after["row_id"].iloc[1] == x["ledger"]["row_id"] and after["accept_length"].iloc[1] == \
        x["summary"]["accept_length"]
    # a rebuild of a readable ledger keeps that one too, under another name
    assert main(["measure", "--rebuild-ledger", str(run)]) == 0
    (older,) = run.glob("ledger.parquet.before-rebuild-*")
    pd.testing.assert_frame_equal(pd.read_parquet(older), after)
    pd.testing.assert_frame_equal(pd.read_parquet(run / "ledger.parquet"), after)
    assert main(["measure", "--rebuild-ledger", str(tmp_path / "nope")]) == 2
    assert "--rebuild-ledger must be an existing run folder" in _one_line_error(capsys, "measure")


def test_bad_local_inputs_are_one_line_exit_2(tmp_path, training, capsys):
    bad = tmp_path / "prompts.jsonl"
    bad.write_text('{"text": "ok"}\nnot json\n')
    assert main(["measure", "--url", "http://127.0.0.1:9", "--prompts", str(bad)]) == 2
    line = _one_line_error(capsys, "measure")
    assert str(bad) in line and "line 2" in line, line
    assert main(["measure", "--url", "http://127.0.0.1:9", "--run-dir", str(tmp_path / "nope")]) == 2
    assert "--run-dir must be an existing run folder" in _one_line_error(capsys, "measure")
    assert main(["suite", "run", "--params", str(tmp_path)]) == 2
    assert "must be a YAML file, not a folder" in _one_line_error(capsys, "suite")
    f = tmp_path / "file"
    f.write_text("x")
    assert main(["suite", "run", "--params", "env/cases/main.yaml", "--out", str(f)]) == 2
    assert "--out must be a folder" in _one_line_error(capsys, "suite")
    assert main(["capture", "--url", "http://127.0.0.1:9", "--training", str(training), "--num-samples", "0"]) == 2
    _one_line_error(capsys, "capture")


def test_full_disk_is_one_line_and_leaves_no_partial_measurement(tmp_path, capsys):
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here (needs root); the ENOSPC path is then untested")
    try:
        (mnt / "filler").write_bytes(b"\0" * (60 << 10))
        (mnt / "run").mkdir()
        with fake_server("ok") as url:
            rc = main(["measure", "--url", url, "--num-prompts", "3", "--max-new-tokens", "4", "--label", "full",
                       "--run-dir", str(mnt / "run"), "--quiet", "--timeout", "60", "--warmup", "0"])
        line = _one_line_error(capsys, "measure")
        assert rc == 1 and "no space left on the device" in line, line
        # the file the user asked for (issue 30), never the temporary folder it is staged in
        assert f"{mnt / 'run' / 'fixes' / 'full'}/" in line and ".tmp" not in line, line
        leftovers = [p.name for p in (mnt / "run").rglob("*")]
        assert not any(n.startswith("full") or n.endswith(".tmp") for n in leftovers), leftovers
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)


def test_a_failed_run_folder_is_removed_when_empty_or_marked(tmp_path, training, capsys):
    from helpers.runfiles import mark_failed

    empty = tmp_path / "empty"
    (empty / "dumps").mkdir(parents=True)
    assert mark_failed(empty, "capture: error") is None and not empty.exists()
    half = tmp_path / "half"
    (half / "dumps").mkdir(parents=True)
    (half / "dumps" / "x.json").write_text("{}")
    assert mark_failed(half, "suite: OSError: no space") == half / "FAILED"
    assert (half / "FAILED").read_text() == "suite: OSError: no space\n"
    # investigate against an unreachable server: one line, exit 1, the run folder holds the partial record + FAILED
    rc = main(["investigate", "--url", "http://127.0.0.1:9", "--training", str(training), "--out",
               str(tmp_path / "runs"), "--timeout", "20"])
    line = _one_line_error(capsys, "investigate")
    assert rc == 1 and "cannot connect" in line, line
    (run,) = list((tmp_path / "runs").iterdir())
    assert (run / "FAILED").exists() and json.loads((run / "investigation.json").read_text())["error"]


# ---------------------------------------------------------------------------------------------------- issue 21 (B)

@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[Path, Path]:
    """A config-only 6-layer target of the fake server's width and an EAGLE-3 draft whose ids ([0, 2, 3]) differ from
    the training data's (out(1), out(3), out(4)): investigate proposes new ids and relaunches."""
    from support.tinymodels import build_eagle3_draft

    root = tmp_path_factory.mktemp("models")
    target = root / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": H, "intermediate_size": 32,
        "num_hidden_layers": 6, "num_attention_heads": 2, "num_key_value_heads": 2, "vocab_size": 64,
        "max_position_embeddings": 256, "torch_dtype": "float32"}))
    return target, build_eagle3_draft(root / "draft", target, layer_ids=[0, 2, 3], draft_vocab=32)


def test_no_api_key_reaches_any_file_of_a_run(training, models, tmp_path, capsys, monkeypatch):
    """Cause 4: a keyed server whose /server_info holds both keys as values, in its launch_command and as (nested)
    dict keys; investigate relaunches it with a command carrying ``--api-key K --admin-api-key=K2`` (the relaunched
    server prints its argv); capture and measure write into the same run folder. No file holds either key."""
    from support.fakeserver import ADMIN_KEY, KEY

    target, draft = models
    monkeypatch.setenv("SGLANG_API_KEY", KEY)
    script = Path(__file__).resolve().parents[2] / "support" / "fakeserver.py"
    relaunch = f"{sys.executable} {script} keyed --api-key {KEY} --admin-api-key={ADMIN_KEY}"
    from helpers.cli.investigate import build_parser     # the acceptance budget, where there is one, needs weights
    no_budget = [a for a in ("--no-budget",) if a in build_parser().format_help()]
    with fake_server("keyed") as url:
        rc = main(["investigate", "--url", url, "--training", str(training), "--target", str(target), "--draft",
                   str(draft), "--relaunch", relaunch, "--out", str(tmp_path), "--timeout", "120", "--prompts", "4",
                   "--max-new-tokens", "4", *no_budget])
        assert rc == 1, capsys.readouterr().err       # a fault named (the ids), measured on the relaunched server
        (run,) = list(tmp_path.iterdir())
        assert main(["capture", "--url", url, "--training", str(training), "--run-dir", str(run), "--num-samples",
                     "1", "--timeout", "60"]) == 0
        assert main(["measure", "--url", url, "--num-prompts", "3", "--max-new-tokens", "4", "--run-dir", str(run),
                     "--quiet", "--timeout", "60", "--warmup", "0"]) == 0
    out = capsys.readouterr()
    assert KEY not in out.out + out.err and ADMIN_KEY not in out.out + out.err
    log = (run / "logs" / "fixed-server.log").read_text()
    assert log.startswith("$ ") and "--api-key <redacted> --admin-api-key=<redacted>" in log.splitlines()[0], log
    assert "fake server keyed" in log                  # the server's own output is in the log, scrubbed
    files = [p for p in run.rglob("*") if p.is_file()]
    for want in ("investigation.json", "dumps/server-served/manifest.json", "dumps/served/manifest.json",
                 "fixes/server/summary.json", "acceptance/after/summary.json", "ledger.parquet", "postmortem.html"):
        assert run / want in files, want
    leaks = [str(p.relative_to(run)) for p in files if KEY.encode() in p.read_bytes() or ADMIN_KEY.encode()
             in p.read_bytes()]
    assert not leaks, leaks
    manifest = json.loads((run / "dumps" / "served" / "manifest.json").read_text())
    assert manifest["server"]["lora_paths"] == {"<redacted>": "/adapters/a", "plain": "/adapters/<redacted>"}




def test_yaml_alias_bombs_in_fixes_and_params_files_are_refused(tmp_path, capsys):
    """Issue 21, cause 5: an alias bomb in a fixes file's draft_config (9 lines and 9^9 values took measure --fixes to
    5.6 GB; 9^7 here, so that a regression costs about a gigabyte, not the machine) and in suite params' common: one
    line naming the file, exit 2, before anything is built (tests/unit/test_runfiles.py: the 9^9 one)."""
    from support import alias_bomb

    fixes = tmp_path / "fixes.yaml"
    fixes.write_text("name: bomb\nfixes:\n  - name: one\n    url: http://127.0.0.1:9\n    draft_config:\n"
                     + alias_bomb(7, indent="      "))
    params = tmp_path / "params.yaml"
    params.write_text("name: bomb\ncommon:\n" + alias_bomb(7, indent="  "))
    for args, path in ((["measure", "--fixes", str(fixes)], fixes),
                       (["suite", "run", "--params", str(params)], params)):
        t = time.monotonic()
        rc = main(args)
        line = _one_line_error(capsys, args[0])
        assert rc == 2 and time.monotonic() - t < 30, (rc, line)      # (the first suite run imports papermill)
        assert line.startswith(f"{args[0]}: error: {path}") and "aliases expand to more than" in line, line


def _measure_some_failing(mode: str, n: int, tmp_path, capsys, tokens: int = 4) -> tuple[str, dict, list[str]]:
    """``measure`` of ``n`` prompts (``tokens`` new tokens each) against the fake server ``mode``: (the error line,
    the saved summary, the per-request errors)."""
    with fake_server(mode) as url:
        rc = main(["measure", "--url", url, "--num-prompts", str(n), "--max-new-tokens", str(tokens), "--warmup", "0",
                   "--outputs", str(tmp_path), "--quiet", "--timeout", "60"])
    line = _one_line_error(capsys, "measure")
    assert rc == 1, line
    (summary,) = list(tmp_path.glob("*/fixes/server/summary.json"))
    errors = sorted(e for e in pd.read_parquet(summary.parent / "per_request.parquet")["error"] if isinstance(e, str))
    return line, json.loads(summary.read_text())["summary"], errors


def test_impossible_spec_counters_are_failed_requests_not_results(tmp_path, capsys):
    """Cause 7: every 2nd answer carries counters no server can produce (50 correct drafts of 3 proposed, negative
    completion tokens, 64 tokens from 2 verify steps of 3 draft steps, a 7-bin histogram with 3 steps): each is a
    failed request naming the counter; the others give a plausible result; exit 1."""
    line, s, errors = _measure_some_failing("impossible", 8, tmp_path, capsys)
    assert "4 of 8 requests failed" in line, line
    assert s["n_failed"] == 4 and s["n_requests"] == 4
    assert 0 <= s["accept_rate"] <= 1 and 1 <= s["accept_length"] <= 3 + 1 + 1 and s["tok_s"] > 0, s
    assert len(errors) == 4 and all("/generate" in e for e in errors), errors
    text = " | ".join(errors)
    for what in ("spec_num_correct_drafts 50 > spec_num_proposed_drafts 3", "completion_tokens",
                 "64 completion tokens", "spec_correct_drafts_histogram has 7 bins"):
        assert what in text, (what, text)


def test_counters_that_break_an_identity_fail_their_request_naming_it(tmp_path, capsys):
    """Issue 27 item 5: a server (topk 2, 8 draft tokens) whose every 2nd answer breaks one identity of SGLang's
    per-request counters in turn -- no verify step yet drafts, accepted > proposed, proposed != verify steps x 7, a
    histogram too long / not summing to the verify steps / not weighting to the accepted drafts, more accepted than
    3 steps allow, more tokens than the steps emit, a reported accept length or rate unlike the counters': each such
    request fails with the request's id, the identity and the numbers, is left out of the figures, and the command
    exits 1 naming the first; the answers that keep every identity are measured."""
    from support.fakeserver import BROKEN_IDENTITIES

    n = 2 * len(BROKEN_IDENTITIES)
    line, s, errors = _measure_some_failing("identities", n, tmp_path, capsys, tokens=8)
    assert f"{len(BROKEN_IDENTITIES)} of {n} requests failed (first: prompt " in line, line
    assert "identity 'no verify step, no draft' broken: spec_num_correct_drafts 3 with spec_verify_ct 0" in line
    assert s["n_failed"] == len(BROKEN_IDENTITIES) and s["n_requests"] == len(BROKEN_IDENTITIES)
    # the answers kept: 4 verify steps of 8 tokens, 1 accepted of 7 proposed each
    assert s["accept_length"] == 2.0 and s["accept_rate"] == pytest.approx(1 / 7) and s["verify_steps"] == 4 * 10
    for k, (name, _) in enumerate(BROKEN_IDENTITIES):
        (e,) = [e for e in errors if f"identity '{name}' broken" in e]
        assert f"/generate (request req-{2 * (k + 1)}): impossible spec counters: identity '{name}' broken: " in e
    text = " | ".join(errors)
    for numbers in ("spec_num_correct_drafts 29 > spec_num_proposed_drafts 28",
                    "spec_num_proposed_drafts 12 != spec_verify_ct 4 x (speculative_num_draft_tokens 8 - 1) = 28",
                    "has 5 bins, more than num_steps + 1 = 4", "spec_num_correct_drafts 13 > 4 verify steps x 3",
                    "10 completion tokens from 4 verify steps (4 accepted draft tokens", "[1, 4, 0, 0] sums to 5",
                    "sum n x spec_correct_drafts_histogram[n] = 3, spec_num_correct_drafts is 4",
                    "reported spec_accept_length 3.5, completion_tokens 8 / spec_verify_ct 4 = 2",
                    "reported spec_accept_rate 0.5, spec_num_correct_drafts 4 / spec_num_proposed_drafts 28 = "
                    "0.142857"):
        assert numbers in text, (numbers, text)


def test_deep_json_answer_is_one_failed_request(tmp_path, capsys):
    """Cause 10: a /generate answer nested 200000 deep is one failed request (RecursionError before), the others
    are measured."""
    line, s, errors = _measure_some_failing("deep", 4, tmp_path, capsys)
    assert "2 of 4 requests failed" in line and s["n_requests"] == 2, line
    assert len(errors) == 2 and all("/generate" in e and "too deeply" in e for e in errors), errors


@pytest.mark.parametrize("mode, expect", [
    ("hugesteps", "field speculative_num_steps"),
    ("infolist", "expected a JSON object (server info), got a list"),
    ("tpstring", "field tp_size"),
    ("redirect", "HTTP 307"),
])
def test_malformed_server_info_is_found_before_the_work(mode, expect, training, tmp_path, capsys):
    """Causes 6 and 10: /server_info with an absurd count, as a list, with a string for a number, or a redirect:
    one line naming the endpoint and the field, exit 1, within seconds, before any request (no run folder)."""
    with fake_server(mode) as url:
        for argv in (["measure", "--url", url, "--num-prompts", "3", "--max-new-tokens", "4", "--outputs",
                      str(tmp_path / "m"), "--quiet", "--timeout", "60"],
                     ["capture", "--url", url, "--training", str(training), "--run-dir", str(tmp_path),
                      "--num-samples", "1", "--timeout", "60"]):
            t = time.monotonic()
            rc = main(argv)
            took = time.monotonic() - t
            line = _one_line_error(capsys, argv[0])
            assert rc == 1 and took < 10 and "/server_info" in line and expect in line, (took, line)
    assert not (tmp_path / "m").exists() or not list((tmp_path / "m").rglob("*.json"))
    assert not (tmp_path / "dumps").exists()


def test_server_error_bodies_reach_the_terminal_without_control_characters(capsys):
    """Cause 11 (part): an error body with escape sequences (screen clear, window title, OSC 52 clipboard write) is
    printed without any control character."""
    with fake_server("escape") as url:
        rc = main(["measure", "--url", url, "--num-prompts", "2", "--max-new-tokens", "4", "--warmup", "0",
                   "--no-save", "--quiet", "--timeout", "30"])
    err = capsys.readouterr().err
    assert rc == 1 and "bad request" in err and "HTTP 400" in err, err
    assert not any(ord(c) < 32 and c != "\n" or 0x7f <= ord(c) < 0xa0 for c in err), repr(err)


# ---------------------------------------------------------------------------------------------------- issue 40 (B)

@pytest.mark.parametrize("prog", ["capture", "measure", "compare-engines"])
def test_one_deadline_covers_engine_detection(prog, training, tmp_path, capsys):
    """Issue 40: against a server that answers no endpoint at all, `capture` / `measure --timeout 3` waited about
    twice the timeout (engine detection had a deadline of its own) while the message said "3 s elapsed": one budget
    now covers detection and the requests, so the whole command ends at the timeout and the elapsed time is true."""
    args = {"capture": ["capture", "--training", str(training), "--run-dir", str(tmp_path), "--num-samples", "1"],
            "measure": ["measure", "--num-prompts", "2", "--max-new-tokens", "4", "--outputs", str(tmp_path / "m"),
                        "--quiet"],
            "compare-engines": ["compare-engines", "--training", str(training), "--out", str(tmp_path / "m")]}[prog]
    with fake_server("hangall") as url, fake_server("hangall") as url_b:
        t = time.monotonic()
        # two servers: --a equal to --b is refused before any request
        where = ["--a", url, "--b", url_b] if prog == "compare-engines" else ["--url", url]
        rc = main(args + where + ["--timeout", "3"])
        took = time.monotonic() - t
    line = _one_line_error(capsys, prog)
    assert rc == 1 and 3.0 <= took <= 3.0 + 1.5, (took, line)
    assert "the overall deadline of 3 s passed (3 s elapsed" in line and url in line, line
    assert not (tmp_path / "dumps").exists() and not list((tmp_path / "m").rglob("*.json"))


@pytest.mark.parametrize("mode, expect", [
    ("infohtml", "answer is not JSON: <!doctype html>"),
    ("infolist", "expected SGLang's server info (a JSON object with a version and its ServerArgs fields), got a "
                 "JSON list"),
    ("infodeep", "the answer nests arrays/objects too deeply (more than 100 levels)"),
    ("infoversion", "field version: Input should be a valid string, got 5"),
    ("tpstring", "field tp_size: Input should be a valid integer"),
])
def test_a_malformed_sglang_server_info_is_named_at_detection(mode, expect, tmp_path, capsys):
    """Issue 40: an SGLang server (by its /model_info) whose /server_info is HTML, a JSON list, JSON nested 200000
    deep, or has a field of the wrong type was "neither SGLang nor vLLM", exit 2, the field unnamed, in every command
    that detects the engine (investigate, compare-engines, ablate, server detect): it is one line naming the endpoint
    and the field (or what it answered) and why the server is taken for SGLang, exit 1, as docs/bad-inputs.md's table says."""
    with fake_server(mode) as url:
        t = time.monotonic()
        rc = main(["server", "detect", "--url", url, "--timeout", "20"])
        line = _one_line_error(capsys, "server")
        assert rc == 1 and time.monotonic() - t < 10, line
        assert f"GET {url}/server_info: " in line and expect in line, line
        assert "neither" not in line, line
        if mode in ("infohtml", "infolist", "infodeep"):    # not an object with SGLang's fields: why it is SGLang
            assert line.endswith("(the server is SGLang by GET /model_info (SGLang's model info, model_path))"), line
