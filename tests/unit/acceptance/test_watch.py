"""``python -m helpers watch`` against fake servers whose /metrics numbers the test controls
(support.fakeserver mode ``metrics``): counters parsed and deltas computed, the probe's load share, a torn JSONL
line skipped, ``--resume``, ``--on-drop investigate`` once per drop, SIGINT leaving a complete JSONL, bad flags."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from helpers.__main__ import main
from helpers.acceptance.prompts import load_prompts
from helpers.acceptance.watch import LOG_NAME, Watcher, WatchLog, WatchSettings, probe_once, read_log
from helpers.draft.decide import threshold
from helpers.engines.detect import detect
from support import ROOT
from support import fakeserver
from support.fakeserver import fake_server

FRESH = dict(fakeserver.METRICS)


class _Metrics(fakeserver.Handler):
    mode = "metrics"


@contextmanager
def metrics_server():
    """An in-process fake SGLang (mode ``metrics``) whose counters the test sets in ``fakeserver.METRICS``."""
    fakeserver.METRICS.clear()
    fakeserver.METRICS.update(FRESH)
    with fakeserver.in_thread(_Metrics) as url:
        yield url


def _watcher(url, run_dir, **kw):
    found = detect(url, deadline_s=10)
    client = found.adapter.client(url, timeout=5, retries=0)
    prompts = iter(load_prompts(None) * 10)
    w = Watcher(WatchLog(run_dir), snapshot=lambda: found.adapter.watch_snapshot(client.metrics_text()),
                probe=lambda: probe_once(client, next(prompts), max_new_tokens=16, timeout=5), **kw)
    return w, client


def test_counters_parsed_and_deltas_computed(tmp_path):
    with metrics_server() as url:
        w, client = _watcher(url, tmp_path)
        m = fakeserver.METRICS
        first = w.step()                                  # no earlier snapshot: the probe's own accept length
        assert first["accept_length_source"] == "probe" and first["interval_s"] is None
        assert first["probe"]["accept_length"] == pytest.approx(16 / 6)      # round(16 / 2.5) = 6 verify steps
        assert first["counters"]["generation_tokens"] == 16 and first["counters"]["verify_steps"] == 6
        assert first["uptime_source"] == "since the first sample"            # SGLang reports no start time
        # other traffic between two samples: 1000 tokens in 400 verify steps, 3000 prompt tokens of which 1200 cached
        m.update(generation_tokens=m["generation_tokens"] + 1000, verify_steps=m["verify_steps"] + 400,
                 prompt_tokens=m["prompt_tokens"] + 3000, cached_tokens=m["cached_tokens"] + 1200,
                 token_usage=0.42, running=7)
        second = w.step()
        client.close()
    d = second["delta"]
    assert d["generation_tokens"] == 1016 and d["verify_steps"] == 406
    assert second["accept_length_source"] == "counters"
    assert second["accept_length"] == pytest.approx(1016 / 406)
    probe_prompt = second["probe"]
    assert second["cache_hit_rate"] == pytest.approx(1200 / (3000 + d["prompt_tokens"] - 3000))
    assert second["cache_hit_rate_source"] == "counters" and d["prompt_tokens"] > 3000
    assert second["kv_cache_use"] == 0.42 and second["running_reqs"] == 7
    assert second["load"]["probe_token_share"] == pytest.approx(16 / 1016)
    assert second["load"]["probe_time_share"] == pytest.approx(probe_prompt["latency_s"] / second["interval_s"])
    assert second["accept_length_gauge"] == 2.5                              # SGLang's gauge, kept beside
    recs = read_log(tmp_path / LOG_NAME)
    assert [r["kind"] for r in recs.records] == ["sample", "sample"] and recs.skipped == 0


def test_a_server_restart_is_seen_not_subtracted(tmp_path):
    with metrics_server() as url:
        w, client = _watcher(url, tmp_path)
        w.step()
        w.step()
        fakeserver.METRICS.update(generation_tokens=0.0, verify_steps=0.0, requests=0.0, prompt_tokens=0.0)
        rec = w.step()
        client.close()
    assert rec["server_restarted"] is True and rec["delta"]["verify_steps"] is None
    assert rec["accept_length_source"] == "probe" and "after a server restart" in rec["uptime_source"]


def _sample(i, al, t):
    return {"kind": "sample", "i": i, "t": t, "accept_length": al, "uptime_s": 30.0 * i,
            "counters": {"generation_tokens": 100.0 * i, "verify_steps": 40.0 * i}}


def test_a_torn_last_line_is_skipped_and_resume_appends(tmp_path):
    log = WatchLog(tmp_path)
    for i in range(12):
        log.append(_sample(i, 2.5, 1000.0 + 30 * i))
    log.close()
    with open(tmp_path / LOG_NAME, "ab") as fh:           # a crash in the middle of a line
        fh.write(b'{"kind": "sample", "i": 12, "t": 13')
    got = read_log(tmp_path / LOG_NAME)
    assert len(got.records) == 12 and got.skipped == 1
    w = Watcher(WatchLog(tmp_path), snapshot=lambda: {"generation_tokens": 1250.0, "verify_steps": 490.0},
                clock=lambda: 1400.0)
    assert w.resume(tmp_path / LOG_NAME) == 12 and w.skipped_on_resume == 1
    assert w.baseline == pytest.approx(2.5) and len(w.window) == 12 and w.first_t == 1000.0
    rec = w.step()
    w.log.close()
    assert rec["i"] == 12 and rec["delta"]["generation_tokens"] == 150.0 and rec["delta"]["verify_steps"] == 50.0
    assert rec["accept_length"] == 3.0 and rec["interval_s"] == pytest.approx(1400.0 - 1330.0)
    assert rec["uptime_s"] == pytest.approx(400.0)                         # since the run's first sample
    got = read_log(tmp_path / LOG_NAME)
    assert len(got.records) == 13 and got.skipped == 1 and got.records[-1]["i"] == 12
    # the torn fragment is still there, on its own line (nothing rewritten)
    assert (tmp_path / LOG_NAME).read_bytes().count(b'{"kind": "sample", "i": 12, "t": 13\n') == 1


def test_memory_stays_bounded_over_many_samples(tmp_path):
    vals = iter(range(10_000))
    w = Watcher(WatchLog(tmp_path), snapshot=lambda: {"generation_tokens": 25.0 * next(vals) * 10,
                                                      "verify_steps": 100.0 * next(vals)},
                settings=WatchSettings(window=30, baseline_n=5))
    for _ in range(60):
        w.step()
    w.log.close()
    assert len(w.window) == 30 and len(w.baseline_values) == 5 and w.n_samples == 60


def test_on_drop_calls_the_handler_once_per_drop(tmp_path):
    """A fake clock and counters: 15 samples at 2.5, then 1.6; the handler runs once (the window restarts at the
    change, so the same drop cannot trigger again), the drop and what the handler returned are in the log."""
    t = [0.0]
    series = [2.5] * 15 + [1.6] * 25
    state = {"g": 0.0, "v": 0.0, "i": 0}

    def snap():
        al = series[state["i"]]
        state["i"] += 1
        state["g"] += al * 100
        state["v"] += 100
        return {"generation_tokens": state["g"], "verify_steps": state["v"]}

    def clock():
        t[0] += 15.0
        return t[0]

    calls = []
    w = Watcher(WatchLog(tmp_path), snapshot=snap, clock=clock, on_drop=lambda n, d: calls.append((n, d)) or
                {"run_dir": str(tmp_path / f"investigation-{n}")},
                settings=WatchSettings(baseline_n=5, drop_frac=0.2, material=threshold, cooldown_s=0))
    for _ in range(40):
        w.step()
    w.log.close()
    assert len(calls) == 1 and calls[0][0] == 1
    d = calls[0][1]
    # it fires as soon as the evidence holds: with 4 samples at 1.6 the split (each side >= 5) takes one 2.5 along
    assert d.trigger and 1.6 <= d.change.after < 1.8 and d.baseline == pytest.approx(2.5)
    kinds = [r["kind"] for r in read_log(tmp_path / LOG_NAME).records]
    assert kinds.count("drop") == 1 and kinds.count("investigation") == 1
    drop = next(r for r in read_log(tmp_path / LOG_NAME).records if r["kind"] == "drop")
    assert 13 <= drop["change"]["i"] <= 15 and drop["change"]["i_ci"][0] <= 15 <= drop["change"]["i_ci"][1]


def test_cli_on_drop_investigate_calls_investigate_once(tmp_path, monkeypatch):
    import helpers.cli.investigate  # noqa: F401  -- imported before the patch: watch's flag checks import it, and a
    import helpers.investigation.live as live  # first import under the patch would keep the fake for later tests

    calls = []

    def fake_investigate(url, **kw):
        calls.append((url, kw))
        Path(kw["run_dir"]).mkdir()
        return live.InvestigationDoc.model_construct(verdict="mismatch", sentence="fake")

    monkeypatch.setattr(live, "investigate", fake_investigate)
    training = tmp_path / "training"
    training.mkdir()
    (training / "train.jsonl").write_text('{"conversations": []}\n')     # an empty folder is refused (--training)
    with metrics_server() as url:
        fakeserver.METRICS.update(drop_after=12, accept_length_after=1.5)
        rc = main(["watch", "--url", url, "--interval", "0.01", "--samples", "30", "--baseline", "5",
                   "--drop-frac", "0.2", "--on-drop", "investigate", "--training", str(training),
                   "--outputs", str(tmp_path / "out"), "--quiet"])
    assert rc == 0
    (run,) = (tmp_path / "out").iterdir()
    assert len(calls) == 1
    got_url, kw = calls[0]
    assert got_url == url and kw["training"] == str(training) and kw["run_dir"] == run / "investigation-1"
    assert kw["apply_fix"] is False and kw["timeout"] == 900.0
    recs = read_log(run / LOG_NAME).records
    assert [r["kind"] for r in recs].count("sample") == 30 and recs[-1]["kind"] == "stop"
    inv = next(r for r in recs if r["kind"] == "investigation")
    assert inv["verdict"] == "mismatch" and inv["run_dir"] == str(run / "investigation-1")
    drop = next(r for r in recs if r["kind"] == "drop")
    assert drop["decision"]["change"]["effect_ci"][1] < 0 and drop["decision"]["material"] == threshold(16 / 6)


def test_cli_resume_appends_to_the_run(tmp_path):
    with metrics_server() as url:
        assert main(["watch", "--url", url, "--interval", "0.01", "--samples", "3", "--outputs", str(tmp_path),
                     "--quiet"]) == 0
        (run,) = tmp_path.iterdir()
        assert main(["watch", "--resume", str(run), "--interval", "0.01", "--samples", "2", "--quiet"]) == 0
    recs = read_log(run / LOG_NAME).records
    assert [r["kind"] for r in recs] == ["start"] + ["sample"] * 3 + ["stop", "start"] + ["sample"] * 2 + ["stop"]
    assert [r["i"] for r in recs if r["kind"] == "sample"] == [0, 1, 2, 3, 4]
    # from the last counters: the light probe's 16 tokens and the fixed probe's 16 (helpers.acceptance.lifecycle)
    assert recs[5]["resumed"] is True and recs[6]["delta"]["generation_tokens"] == 16 + 16
    assert recs[6]["load"]["probe_tokens"] == 32 and recs[6]["load"]["probe_token_share"] == 1.0


@pytest.mark.parametrize("args, says", [
    (["--interval", "0"], "--interval must be > 0"),
    (["--drop-frac", "1.5"], "--drop-frac must be between 0 and 1"),
    (["--on-drop", "investigate", "--drop-frac", "0.2"], "--on-drop investigate needs --training"),
    (["--samples", "0"], "--samples must be >= 1"),
])
def test_bad_flags_are_one_line_exit_2(args, says, capsys):
    assert main(["watch", "--url", "http://127.0.0.1:9", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0] and err[0].startswith("watch: error:")


def test_resume_of_a_folder_that_is_not_a_watch_run(tmp_path, capsys):
    assert main(["watch", "--resume", str(tmp_path)]) == 2
    assert "no watch.jsonl" in capsys.readouterr().err


def test_watch_takes_out_like_every_other_command_and_outputs_as_its_old_name(tmp_path, capsys):
    """Issue 40: ``--out`` is the documented name (the other commands' and docs/cli.md's), ``--outputs`` kept."""
    from helpers.cli.watch import build_parser
    for flag in ("--out", "--outputs"):
        assert build_parser().parse_args(["--url", "http://127.0.0.1:1", flag, str(tmp_path)]).out == str(tmp_path)
    (tmp_path / "file").write_text("x")
    assert main(["watch", "--url", "http://127.0.0.1:1", "--samples", "1", "--out", str(tmp_path / "file")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"watch: error: {tmp_path / 'file'}: --out must be a folder") and "\n" not in err, err
    row = next(ln for ln in (ROOT / "docs" / "cli.md").read_text().splitlines() if ln.startswith("| `watch --url URL"))
    assert "[--out DIR]" in row.split("` |")[0], row


def test_an_unreachable_server_is_exit_1_and_no_folder(tmp_path, capsys):
    with fake_server("ok") as url:
        pass                                # stopped: nothing listens there any more
    assert main(["watch", "--url", url, "--samples", "1", "--out", str(tmp_path), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("watch: error:") and "connect" in err and not list(tmp_path.iterdir())


def test_sigint_leaves_a_complete_jsonl(tmp_path):
    with fake_server("metrics") as url:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        proc = subprocess.Popen([sys.executable, "-m", "helpers", "watch", "--url", url, "--interval", "0.2",
                                 "--outputs", str(tmp_path), "--quiet"], cwd=ROOT, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            deadline = time.monotonic() + 60
            log = None
            while time.monotonic() < deadline:
                runs = list(tmp_path.iterdir())
                log = runs[0] / LOG_NAME if runs else None
                if log and log.exists() and log.read_bytes().count(b'"kind": "sample"') >= 3:
                    break
                time.sleep(0.1)
            proc.send_signal(signal.SIGINT)
            out, err = proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == 130, err
    raw = log.read_bytes()
    assert raw.endswith(b"\n")
    lines = [json.loads(x) for x in raw.decode().splitlines()]       # every line whole
    assert lines[0]["kind"] == "start" and lines[-1]["kind"] == "stop" and "SIGINT" in lines[-1]["reason"]
    assert sum(r["kind"] == "sample" for r in lines) >= 3
    assert not (log.parent / "FAILED").exists()


def test_each_engines_snapshot_from_its_own_metric_names():
    """SGLang 0.5.23: counters summed over label sets, a per-rank ratio gauge averaged; vLLM 0.32.0: the spec-decode
    and prefix-cache counters, ``kv_cache_usage_perc`` averaged over engines, the process start time as uptime's
    origin. Through the adapters (``watch_snapshot``), as ``watch`` reads them."""
    from helpers.engines.detect import adapter

    sg = adapter("sglang").watch_snapshot(
        '# TYPE sglang:generation_tokens_total counter\n'
        'sglang:generation_tokens_total{is_streaming="false"} 900\n'
        'sglang:generation_tokens_total{is_streaming="true"} 100\n'
        '# TYPE sglang:spec_verify_calls_total counter\nsglang:spec_verify_calls_total{dp="0"} 250\n'
        'sglang:spec_verify_calls_total{dp="1"} 150\n'
        '# TYPE sglang:token_usage gauge\nsglang:token_usage{dp="0"} 0.2\nsglang:token_usage{dp="1"} 0.6\n'
        '# TYPE sglang:num_running_reqs gauge\nsglang:num_running_reqs{dp="0"} 3\nsglang:num_running_reqs{dp="1"} 4\n')
    assert sg["generation_tokens"] == 1000 and sg["verify_steps"] == 400 and sg["running_reqs"] == 7
    assert sg["kv_cache_use"] == pytest.approx(0.4) and sg["start_time"] is None and sg["engine"] == "sglang"
    assert "metrics_collector.py" in sg["sources"]["verify_steps"]
    vl = adapter("vllm").watch_snapshot(
        '# TYPE vllm:generation_tokens_total counter\nvllm:generation_tokens_total{engine="0"} 500\n'
        '# TYPE vllm:spec_decode_num_drafts_total counter\nvllm:spec_decode_num_drafts_total{engine="0"} 200\n'
        '# TYPE vllm:spec_decode_num_accepted_tokens_total counter\n'
        'vllm:spec_decode_num_accepted_tokens_total{engine="0"} 290\n'
        '# TYPE vllm:prefix_cache_queries_total counter\nvllm:prefix_cache_queries_total{engine="0"} 1000\n'
        '# TYPE vllm:prefix_cache_hits_total counter\nvllm:prefix_cache_hits_total{engine="0"} 250\n'
        '# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{engine="0"} 0.3\n'
        'vllm:kv_cache_usage_perc{engine="1"} 0.5\n'
        '# TYPE process_start_time_seconds gauge\nprocess_start_time_seconds 1.7e9\n')
    assert vl["verify_steps"] == 200 and vl["accepted_tokens"] == 290 and vl["prompt_tokens"] == 1000
    assert vl["cached_tokens"] == 250 and vl["kv_cache_use"] == pytest.approx(0.4) and vl["start_time"] == 1.7e9
    assert vl["accept_length_gauge"] is None and vl["engine"] == "vllm"


def test_uptime_from_the_servers_own_start_time(tmp_path):
    w = Watcher(WatchLog(tmp_path), snapshot=lambda: {"generation_tokens": 10.0, "verify_steps": 4.0,
                                                      "start_time": 1000.0}, clock=lambda: 4600.0)
    rec = w.step()
    w.log.close()
    assert rec["uptime_s"] == 3600.0 and rec["uptime_source"].startswith("server start time")


def test_a_trickling_probe_is_cut_at_its_deadline_and_the_watch_goes_on(tmp_path):
    """A server whose /generate sends one byte every 0.5 s forever: each probe ends at --probe-timeout (its own
    overall deadline, not the per-read one the bytes keep resetting), is recorded as the sample's probe_error, and the
    counters are still sampled."""
    with fake_server("trickle") as url:
        t0 = time.monotonic()
        rc = main(["watch", "--url", url, "--interval", "0.1", "--samples", "2", "--probe-timeout", "1",
                   "--outputs", str(tmp_path), "--quiet"])
        took = time.monotonic() - t0
    assert rc == 0 and took < 15, took
    (run,) = tmp_path.iterdir()
    samples = [r for r in read_log(run / LOG_NAME).records if r["kind"] == "sample"]
    assert len(samples) == 2 and all("deadline" in (s["probe_error"] or "") for s in samples), samples[0]
    assert all(s["probe"] is None and s["accept_length"] is None for s in samples)


def test_duration_stops_the_loop_and_failures_in_a_row_end_it(tmp_path):
    from helpers.acceptance.watch import run_loop

    now = [0.0]
    w = Watcher(WatchLog(tmp_path), snapshot=lambda: {"generation_tokens": 10.0 * now[0], "verify_steps": 4.0 * now[0]},
                clock=lambda: now[0])
    why = run_loop(w, interval=10.0, duration=35.0, sleep=lambda s: now.__setitem__(0, now[0] + s))
    assert w.n_samples == 4 and "--duration" in why            # at 0, 10, 20, 30 s

    def broken():
        raise RuntimeError("metrics gone")

    (tmp_path / "b").mkdir()
    w2 = Watcher(WatchLog(tmp_path / "b"), snapshot=broken, clock=lambda: now[0])
    with pytest.raises(RuntimeError, match="metrics gone"):
        run_loop(w2, interval=1.0, max_failures=3, sleep=lambda s: None)
    errors = [r for r in read_log(tmp_path / "b" / LOG_NAME).records if r["kind"] == "error"]
    assert [e["in_a_row"] for e in errors] == [1, 2, 3]
