"""`ablate` against inputs its authors did not write (fake servers on 127.0.0.1, tests/support/fakeserver.py): a run
cut short by a signal keeps what it measured, contexts no server can take are refused or skipped before a prompt is
built, a --relaunch or --url that is not one is bad input before any work, failed requests and a restarted copy that
does not start exit 1 with one line, a name given twice runs once."""
from __future__ import annotations

import json
import signal
import time

import pytest

from helpers.__main__ import main
from helpers.acceptance.prompts import load_prompts
from helpers.acceptance.sweeps import run_sweep, with_prefix
from helpers.budget import Budget
from helpers.cli.common import subset_arg
from helpers.errors import BadInput, Interrupted
from helpers.investigation.ablate import ablate
from helpers.server.restart import relaunch_argv
from helpers.server.client import SGLangClient
from support.fakeserver import fake_server


@pytest.fixture(scope="module")
def engine():
    with fake_server("workload") as url:
        yield url


def test_a_signal_mid_sweep_keeps_every_point_measured_and_says_what_did_not_run(engine, tmp_path):
    lines = []

    def progress(line):             # SIGINT arrives once the concurrency sweep's 2nd point is in
        lines.append(line)
        if line.startswith("concurrency: 2 in flight"):
            raise Interrupted(signal.SIGINT)
    run = tmp_path / "run"
    with pytest.raises(Interrupted):
        ablate(engine, run_dir=run, sweeps=["temperature", "concurrency", "context"], toggles=["radix_cache_off"],
               budget_s=60, num_prompts=4, max_new_tokens=8, concurrency=(1, 2, 4), relaunch="false",
               progress=progress)
    doc = json.loads((run / "results" / "ablate.json").read_text())
    assert doc["stopped"] == "interrupted by SIGINT"
    assert [p["label"] for p in doc["sweeps"]["temperature"]["points"]] == ["temperature 0", "temperature 1"]
    assert [p["label"] for p in doc["sweeps"]["concurrency"]["points"]] == ["1 in flight", "2 in flight"]
    assert doc["skipped"] == ["sweep concurrency: cut short after 2 point(s) (interrupted by SIGINT)",
                              "sweep context: not run (interrupted by SIGINT)",
                              "toggle radix_cache_off: not run (interrupted by SIGINT)"]
    for sw in doc["sweeps"].values():          # each point was saved as it was measured, with its request counts
        for p in sw["points"]:
            assert (run / p["summary"]["saved_to"] / "per_request.parquet").exists()
            assert p["summary"]["n_requests"] == 4 and p["summary"]["n_failed"] == 0


def test_contexts_beyond_the_target_are_skipped_before_a_prompt_is_built(engine):
    ps = load_prompts(None, n=3)
    with SGLangClient(engine) as c:
        t0 = time.perf_counter()
        pts = run_sweep(c, "context", prompts=ps, max_new_tokens=8, budget=Budget(60), limits={"target": 1024},
                        contexts=[300, 10 ** 9])
    assert time.perf_counter() - t0 < 30
    assert pts[1].skipped is None and pts[1].result.summary["n_requests"] == 3
    assert pts[2].skipped == "beyond the target's context length 1024 (the server refuses longer inputs)"
    # a long prefix is one join, cut to the exact length
    long = with_prefix(ps, ps, chars=5_000_000)
    assert all(len(p.text) == 5_000_000 + 2 + len(q.text) for p, q in zip(long, ps))


def test_bad_arguments_are_refused_before_any_work(engine, tmp_path, capsys):
    out = tmp_path / "runs"
    for bad, field in ((["--relaunch", "'unterminated"], "--relaunch"),
                       (["--relaunch", "/nonexistent/bin --port 1"], "--relaunch"),
                       (["--relaunch", "   "], "--relaunch"),
                       (["--contexts", str(10 ** 12)], "--contexts"),
                       (["--concurrency", "100000"], "--concurrency")):
        assert main(["ablate", "--url", engine, "--out", str(out), *bad]) == 2, bad
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [e for e in err if e.startswith("ablate: error:")] and field in err[-1], err
        assert not out.exists() or not any(out.iterdir())
    for url in ("http://[::1", "ftp://127.0.0.1:1"):
        assert main(["ablate", "--url", url, "--out", str(out), "--sweeps", "none"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1].startswith("ablate: error: [--url]") and "Traceback" not in "\n".join(err), err
    assert relaunch_argv("python -m sglang.launch_server --model-path 'a b'")[-1] == "a b"
    with pytest.raises(BadInput, match="--relaunch"):
        relaunch_argv('"')
    assert subset_arg("context,context,temperature,context", ["context", "temperature"], "--sweeps") == \
        ["context", "temperature"]


def test_failed_requests_and_a_copy_that_does_not_start_exit_1_with_one_line(engine, tmp_path, capsys):
    with fake_server("impossible") as url:
        rc = main(["ablate", "--url", url, "--out", str(tmp_path / "a"), "--sweeps", "temperature",
                   "--num-prompts", "4", "--max-new-tokens", "8"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and err[-1].startswith("ablate: error: sweep temperature: temperature 0: 2 of 4 requests failed")
    doc = json.loads(next((tmp_path / "a").glob("*/results/ablate.json")).read_text())
    assert [p["summary"]["n_failed"] for p in doc["sweeps"]["temperature"]["points"]] == [2, 2]
    assert len(doc["failed_requests"]) == 2
    rc = main(["ablate", "--url", engine, "--out", str(tmp_path / "b"), "--sweeps", "none", "--toggles",
               "radix_cache_off,radix_cache_off", "--relaunch", "false", "--num-prompts", "2", "--max-new-tokens", "4"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and err[-1].startswith("ablate: error: toggle radix_cache_off failed: ") and "exited" in err[-1]
    doc = json.loads(next((tmp_path / "b").glob("*/results/ablate.json")).read_text())
    assert [r["name"] for r in doc["toggles"]] == ["radix_cache_off"]          # given twice, run once


def test_the_page_escapes_what_a_results_file_says_and_survives_wrong_types():
    from helpers.views.ablate import ablation_parts
    x = "<script>alert(1)</script>"
    doc = {"url": x, "sglang_version": x, "device": x, "prompts": x, "max_new_tokens": x, "wall_s": x,
           "budget_s": None, "stopped": x, "findings": [{"kind": x, "detail": x}], "skipped": [x],
           "sweeps": {x: {"points": [{"label": x, "skipped": x, "summary": {"accept_length": x, "tok_s": 3.0,
                                                                             "tok_s_lo": x}, "effect": {}}],
                          "trend": None}},
           "toggles": [{"name": x, "flags": {x: x}, "status": "skipped", "reason": x, "report": x}]}
    html = [p for p in ablation_parts(doc) if isinstance(p, str)]
    assert html and not any("<script>" in h for h in html)
    assert "cut short" in html[1] and "&lt;script&gt;" in html[1]


def test_a_server_info_that_lies_is_left_out_not_a_crash():
    from helpers.acceptance.ablations import TOGGLES
    from helpers.investigation.ablate import limits
    for bad in (-5, "abc", [1], True, 0):
        assert "target" not in limits({"context_length": bad}), bad
    assert limits({"context_length": 4096})["target"] == 4096
    for version in ("banana", "", None, 7):
        info = {"version": version, "device": {"weird": 1}, "speculative_algorithm": "EAGLE3"}
        reasons = {t.name: t.skip_reason(info) for t in TOGGLES}
        assert reasons["radix_cache_off"] is None and "no spec v1" in reasons["spec_v1"], (version, reasons)
