"""``watch`` against what the adversarial tester found (notes: items 6-11, 14, 16), each on the in-thread fake SGLang
of mode ``metrics`` (support.fakeserver) or on the Watcher / log directly: a lifecycle change across a failed read,
impossible probe counters before the first sample, a watch where no sample succeeds, a hostile ``--resume`` log, two
watches on one folder, numeric flags out of bounds, ``/metrics`` that is not Prometheus text or out of range, and a
Ctrl-C during ``--on-event check-draft``."""
from __future__ import annotations

import json
import os
import signal
import time
import tracemalloc
from types import SimpleNamespace

import pytest

from helpers.__main__ import main
from helpers.acceptance.lifecycle import Lifecycle
from helpers.acceptance.prompts import load_prompts
from helpers.budget import reset_interrupt
from helpers.acceptance.watch import LOG_NAME, Watcher, WatchLog, format_line, iter_log, probe_once, read_log, \
    run_loop
from helpers.errors import BadInput, Interrupted
from support import fakeserver

from test_watch import FRESH, metrics_server  # the in-thread fake of mode metrics, fresh counters


# -- 6: a lifecycle change across a failed read -------------------------------------------------------------------

def test_a_weight_version_change_across_a_failed_read_is_an_event():
    """v1, v1, HTTP 500, v2: the change is compared with the last value read (v1), and says a read failed between."""
    answers = iter([{"weight_version": "v1"}, {"weight_version": "v1"}, None, {"weight_version": "v2"}])

    def model_info():
        got = next(answers)
        if got is None:
            raise RuntimeError("HTTP 500")
        return got

    life = Lifecycle(model_info=model_info)
    evs = [life.finish(life.observe(), {})[1] for _ in range(4)]
    assert evs[:3] == [[], [], []]
    assert life.last["weight_version"] == "v2"
    (ev,) = evs[3]
    assert (ev["event"], ev["before"], ev["after"]) == ("weight_version_changed", "v1", "v2")
    assert "failed in between" in ev["note"]


# -- 7: impossible probe counters, before the first sample and with --no-events ------------------------------------

def test_impossible_probe_counters_never_enter_the_series_even_with_no_events(tmp_path):
    """16 tokens in 1 verify step on a server of num_steps 3 (at most 1 + 3 + 1 = 5): the first probe already fails
    (the settings were read before it), so no sample's accept length is the impossible 16."""
    with metrics_server() as url:
        fakeserver.METRICS["meta_override"] = {"spec_verify_ct": 1, "spec_num_proposed_drafts": 3,
                                               "spec_num_correct_drafts": None}
        rc = main(["watch", "--url", url, "--interval", "0.01", "--samples", "2", "--no-events", "--out",
                   str(tmp_path), "--quiet"])
    assert rc == 0
    (run,) = tmp_path.iterdir()
    recs = read_log(run / LOG_NAME).records
    samples = [r for r in recs if r["kind"] == "sample"]
    assert len(samples) == 2 and all(s["probe"] is None for s in samples)
    assert all("impossible spec counters" in s["probe_error"] for s in samples), samples[0]["probe_error"]
    assert "16 completion tokens from 1 verify steps (at most 3 draft tokens each" in samples[0]["probe_error"]
    assert samples[0]["accept_length"] != 16 and samples[0]["accept_length_source"] != "probe"
    assert recs[0]["server_settings"]["speculative_num_steps"] == 3


def test_a_probe_answer_with_more_tokens_than_asked_is_refused():
    m = SimpleNamespace(completion_tokens=10 ** 9, spec_verify_ct=1, cached_tokens=0)
    client = SimpleNamespace(generate=lambda **kw: SimpleNamespace(meta_info=m, latency_s=0.1))
    with pytest.raises(Exception, match=r"completion_tokens 1000000000 > the 16 max_new_tokens"):
        probe_once(client, load_prompts(None)[0], max_new_tokens=16, timeout=5)


# -- 8: no sample succeeded -----------------------------------------------------------------------------------------

def _broken():
    raise RuntimeError("metrics gone")


def test_failures_reach_max_failures_whatever_samples_says(tmp_path):
    w = Watcher(WatchLog(tmp_path), snapshot=_broken, clock=lambda: 0.0)
    with pytest.raises(RuntimeError, match="metrics gone"):
        run_loop(w, interval=1.0, samples=2, max_failures=3, sleep=lambda s: None)
    w.log.close()
    errors = [r for r in read_log(tmp_path / LOG_NAME).records if r["kind"] == "error"]
    assert [e["in_a_row"] for e in errors] == [1, 2, 3]


def test_a_duration_with_no_sample_that_succeeded_is_an_error(tmp_path):
    now = [0.0]
    w = Watcher(WatchLog(tmp_path), snapshot=_broken, clock=lambda: now[0])
    with pytest.raises(Exception, match="no sample succeeded"):
        run_loop(w, interval=10.0, duration=25.0, max_failures=100, sleep=lambda s: now.__setitem__(0, now[0] + s))
    w.log.close()


class _TurnsHtml(fakeserver.Handler):
    """Mode metrics whose /metrics is an HTML page after the first read (a proxy's error page)."""
    mode = "metrics"
    reads = [0]

    def do_GET(self):
        if self.path == "/metrics":
            self.reads[0] += 1
            if self.reads[0] > 1:
                data = b"<html><body>502 Bad Gateway</body></html>\n"
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                return self.wfile.write(data)
        return super().do_GET()


def test_every_sample_failing_is_exit_1_and_html_metrics_is_one_line(tmp_path, capsys):
    """Items 8 and 14: /metrics turns into an HTML page; each sample fails with one line naming the endpoint (no
    traceback), and --max-failures 3 ends the run with exit 1 although --samples is 2."""
    fakeserver.METRICS.clear()
    fakeserver.METRICS.update(FRESH)
    _TurnsHtml.reads[0] = 0
    with fakeserver.in_thread(_TurnsHtml) as url:
        rc = main(["watch", "--url", url, "--interval", "0.01", "--samples", "2", "--max-failures", "3", "--out",
                   str(tmp_path)])
    assert rc == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    (run,) = tmp_path.iterdir()
    errors = [r for r in read_log(run / LOG_NAME).records if r["kind"] == "error"]
    assert len(errors) == 3
    assert all("GET /metrics: not the Prometheus text format" in e["error"] and "<html>" in e["error"]
               for e in errors), errors[0]
    assert err.strip().splitlines()[-1].startswith("watch: error:") and "/metrics" in err.strip().splitlines()[-1]


# -- 9: a hostile --resume log --------------------------------------------------------------------------------------

START = {"kind": "start", "format": "e3f-watch", "version": 1, "t": 1000.0, "url": "http://127.0.0.1:1"}


def _log(path, *recs):
    path.mkdir(exist_ok=True)
    (path / LOG_NAME).write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


@pytest.mark.parametrize("bad, field", [
    ({"kind": "sample", "i": "abc", "t": 1030.0}, "i"),
    ({"kind": "sample", "i": None, "t": 1030.0}, "i"),
    ({"kind": "sample", "i": 1e300, "t": 1030.0}, "i"),
    ({"kind": "sample", "i": 3, "t": 1030.0, "counters": "garbage"}, "counters"),
    ({"kind": "sample", "i": 3, "t": 1030.0, "lifecycle": [1]}, "lifecycle"),
    ({"kind": "sample", "i": 3, "t": 1030.0, "counters": {"verify_steps": "x"}}, "counters.verify_steps"),
    ({"kind": "event", "n": "x", "t": 1030.0}, "n"),
    ({"kind": "drop", "n": 1, "t": 1030.0, "reset_from": "zz"}, "reset_from"),
    ({"kind": "drop", "n": 1, "t": 9e12}, "t"),
])
def test_resume_refuses_a_damaged_line_naming_file_line_and_field(tmp_path, bad, field):
    run = _log(tmp_path / "run", START, {"kind": "sample", "i": 0, "t": 1000.0, "accept_length": 2.5}, bad)
    (tmp_path / "new").mkdir()
    w = Watcher(WatchLog(tmp_path / "new"), snapshot=dict, clock=lambda: 2000.0)
    with pytest.raises(BadInput) as got:
        w.resume(run / LOG_NAME)
    w.log.close()
    msg = str(got.value)
    assert msg.startswith(str(run / LOG_NAME)) and f"[{field}]" in msg and "line 3" in msg, msg


@pytest.mark.parametrize("first, says", [
    ({**START, "url": 12345}, "url"),
    ({**START, "url": ["http://x"]}, "url"),
    ({"kind": "start", "format": "something-else", "t": 1.0, "url": "http://x"}, "format"),
    ({"kind": "note", "text": "an unrelated JSONL"}, "not a watch log"),
])
def test_cli_resume_of_an_unrelated_log_is_exit_2(tmp_path, capsys, first, says):
    run = _log(tmp_path / "run", first)
    assert main(["watch", "--resume", str(run), "--samples", "1", "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and str(run / LOG_NAME) in err and says in err, err


def test_a_symlinked_log_is_refused_and_nothing_appended(tmp_path, capsys):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    (tmp_path / "run").mkdir()
    os.symlink(victim, tmp_path / "run" / LOG_NAME)
    assert main(["watch", "--resume", str(tmp_path / "run"), "--url", "http://127.0.0.1:1", "--samples", "1"]) == 2
    assert "symlink" in capsys.readouterr().err
    with pytest.raises(BadInput, match="symlink"):
        WatchLog(tmp_path / "run")
    assert victim.read_text() == "precious\n"


def test_a_giant_torn_line_is_read_in_bounded_memory(tmp_path):
    run = _log(tmp_path / "run", START, {"kind": "sample", "i": 0, "t": 1000.0, "accept_length": 2.5})
    with open(run / LOG_NAME, "ab") as fh:
        fh.write(b'{"kind": "sample", "i": 1, "x": "' + b"y" * (12 << 20))        # 12 MiB, no newline
    tracemalloc.start()
    skipped: list = []
    recs = list(iter_log(run / LOG_NAME, skipped))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert [r["kind"] for r in recs] == ["start", "sample"] and skipped == [3]
    assert peak < 4 << 20, peak


# -- 10: one watch per run folder -----------------------------------------------------------------------------------

def test_a_second_watch_on_the_same_folder_is_refused_naming_the_pid(tmp_path, capsys):
    with metrics_server() as url:
        assert main(["watch", "--url", url, "--interval", "0.01", "--samples", "1", "--out", str(tmp_path),
                     "--quiet"]) == 0
        (run,) = tmp_path.iterdir()
        held = WatchLog(run)                                           # another watch writing this folder
        try:
            assert main(["watch", "--resume", str(run), "--interval", "0.01", "--samples", "1", "--quiet"]) == 2
        finally:
            held.close()
        assert f"another watch (PID {os.getpid()})" in capsys.readouterr().err
        assert main(["watch", "--resume", str(run), "--interval", "0.01", "--samples", "1", "--quiet"]) == 0
    kinds = [r["kind"] for r in read_log(run / LOG_NAME).records]
    assert kinds == ["start", "sample", "stop", "start", "sample", "stop"]


# -- 11: numeric flags and the paths the handlers read ----------------------------------------------------------------

@pytest.mark.parametrize("args, says", [
    (["--request-timeout", "inf"], "--request-timeout must be > 0 and <= 86400"),
    (["--window", "99999999999999999999"], "--window must be >= 10 and <= 100000"),
    (["--interval", "inf"], "--interval must be > 0 and <= 86400"),
    (["--probe-timeout", "inf"], "--probe-timeout must be > 0"),
    (["--probe-tokens", "99999999999999999999"], "--probe-tokens must be >= 0 and <= 4096"),
    (["--cooldown", "nan"], "--cooldown must be >= 0"),
    (["--duration", "inf"], "--duration must be > 0"),
    (["--on-event", "check-draft", "--draft", "/nonexistent/draft"], "[--draft]: not found"),
    (["--on-event", "check-draft", "--target", "/missing/target"], "[--target]: not found"),
])
def test_numeric_flags_out_of_bounds_and_missing_paths_are_exit_2(args, says, capsys):
    assert main(["watch", "--url", "http://127.0.0.1:9", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0], err


@pytest.mark.parametrize("make, says", [("fifo", "expected a file or a folder, got a fifo"),
                                        ("empty", "an empty folder"), ("loop", "cannot be read")])
def test_on_drop_investigate_training_is_checked_before_the_first_sample(tmp_path, capsys, make, says):
    t = tmp_path / "training"
    if make == "fifo":
        os.mkfifo(t)
    elif make == "empty":
        t.mkdir()
    else:
        os.symlink(t, t)
    assert main(["watch", "--url", "http://127.0.0.1:9", "--on-drop", "investigate", "--training", str(t)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "[--training]" in err and says in err.lower(), err


class _SlowMetrics(fakeserver.Handler):
    mode = "metrics"

    def do_GET(self):
        if self.path == "/metrics":
            time.sleep(1.5)
        try:
            return super().do_GET()
        except (BrokenPipeError, ConnectionResetError):      # the watch gave up on it: nothing to print
            return None


def test_a_hung_metrics_names_the_flag_watch_has(tmp_path, capsys):
    fakeserver.METRICS.clear()
    fakeserver.METRICS.update(FRESH)
    with fakeserver.in_thread(_SlowMetrics) as url:
        assert main(["watch", "--url", url, "--request-timeout", "0.3", "--samples", "1", "--out",
                     str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "--request-timeout" in err and "(--timeout)" not in err, err


# -- 14: /metrics out of range, empty, lagging ------------------------------------------------------------------------

@pytest.mark.parametrize("change, metric", [(dict(token_usage=-5.0), "sglang:token_usage"),
                                            (dict(cache_hit_rate=7.0), "sglang:cache_hit_rate"),
                                            (dict(running=-3.0), "sglang:num_running_reqs")])
def test_gauges_out_of_range_are_refused_naming_the_metric(tmp_path, capsys, change, metric):
    with metrics_server() as url:
        fakeserver.METRICS.update(change)
        assert main(["watch", "--url", url, "--samples", "1", "--out", str(tmp_path), "--quiet"]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"GET /metrics: {metric} is" in err, err
    assert not list(tmp_path.iterdir())                              # refused before any folder


def test_an_empty_metrics_warns_once_and_the_accept_length_is_the_probes(tmp_path, capsys):
    class _NoMetrics(fakeserver.Handler):
        mode = "ok"                                                   # /metrics: "# no metrics"

    with fakeserver.in_thread(_NoMetrics) as url:
        assert main(["watch", "--url", url, "--interval", "0.01", "--samples", "3", "--no-events", "--out",
                     str(tmp_path)]) == 0
    (run,) = tmp_path.iterdir()
    recs = read_log(run / LOG_NAME).records
    warnings = [r for r in recs if r["kind"] == "warning"]
    assert len(warnings) == 1 and "from the probe only" in warnings[0]["warning"]
    samples = [r for r in recs if r["kind"] == "sample"]
    assert [s["accept_length_source"] for s in samples] == ["probe"] * 3
    assert capsys.readouterr().err.count("WARNING /metrics has none of the counters") == 1


def test_probe_tokens_above_the_servers_delta_say_counters_lag(tmp_path):
    g = iter([100.0, 104.0])
    probe = {"prompt_id": "p", "completion_tokens": 16, "verify_ct": 6, "accept_length": 16 / 6,
             "accept_rate": None, "cached_tokens": 0, "latency_s": 0.1}
    t = iter([0.0, 1.0, 30.0, 31.0])
    w = Watcher(WatchLog(tmp_path), snapshot=lambda: {"generation_tokens": next(g), "verify_steps": 40.0},
                probe=lambda: dict(probe), clock=lambda: next(t))
    w.step()
    rec = w.step()
    w.log.close()
    assert rec["load"]["probe_tokens"] == 16 and rec["load"]["server_tokens"] == 4.0
    assert rec["load"]["probe_token_share"] is None and "counters lag" in rec["load"]["counters_lag"]
    assert "load counters lag" in format_line(rec)


# -- 16: Ctrl-C during --on-event check-draft -------------------------------------------------------------------------

def test_ctrl_c_during_check_draft_marks_it_failed_and_records_interrupted(tmp_path, monkeypatch):
    import helpers.investigation.check_draft as cd

    def interrupted_check(url, **kw):
        kw["run_dir"].mkdir()
        (kw["run_dir"] / "check_draft.json").write_text("{}")
        raise Interrupted(signal.SIGINT)

    monkeypatch.setattr(cd, "check_draft", interrupted_check)
    with metrics_server() as url:
        fakeserver.METRICS.update(weight_version="v1")

        class _Sync(fakeserver.Handler):
            mode = "metrics"

            def do_GET(self):
                if fakeserver.METRICS["requests"] >= 4:
                    fakeserver.METRICS["weight_version"] = "v2"
                return super().do_GET()

        with fakeserver.in_thread(_Sync) as url2:
            try:
                rc = main(["watch", "--url", url2, "--interval", "0.01", "--samples", "5", "--on-event",
                           "check-draft", "--out", str(tmp_path), "--quiet"])
            finally:
                reset_interrupt()                  # a process ends at a signal; this test's process goes on
    assert rc == 130
    (run,) = tmp_path.iterdir()
    assert (run / "check-draft-1" / "FAILED").read_text().startswith("watch check-draft-1: interrupted by SIGINT")
    assert not (run / "FAILED").exists()
    recs = read_log(run / LOG_NAME).records
    assert [r["kind"] for r in recs][-3:] == ["event", "check_draft", "stop"]
    assert recs[-2]["verdict"] == "interrupted" and "SIGINT" in recs[-2]["reason"]


def test_a_verify_step_accepts_at_most_draft_tokens_minus_one():
    """Item 7's draft-token bound: topk 4, num_steps 5, 4 draft tokens (the tree's root and 3 drafts:
    sglang/srt/speculative/eagle_utils.py::build_tree_kernel_efficient): 4 accepted per verify step is impossible
    although num_steps is 5; 3 is not."""
    from helpers.server.protocol import MetaInfo

    ok = MetaInfo(completion_tokens=9, spec_verify_ct=2, spec_num_correct_drafts=6, spec_num_proposed_drafts=6)
    assert ok.spec_problem(num_steps=5, num_draft_tokens=4) is None
    bad = MetaInfo(completion_tokens=11, spec_verify_ct=2, spec_num_correct_drafts=8, spec_num_proposed_drafts=6)
    assert "accepted <= proposed" in bad.spec_problem(num_steps=5, num_draft_tokens=4)
    no_c = MetaInfo(completion_tokens=10, spec_verify_ct=2, spec_num_proposed_drafts=6)
    got = no_c.spec_problem(num_steps=5, num_draft_tokens=4)
    assert "10 completion tokens from 2 verify steps (at most 3 draft tokens each" in got, got


def test_ctrl_c_during_an_on_drop_investigation_is_recorded(tmp_path):
    """The same for ``--on-drop investigate``: the ``investigation`` line says interrupted, then the signal goes on."""
    series = iter([2.5] * 15 + [1.6] * 25)
    state = {"g": 0.0, "v": 0.0}
    t = [0.0]

    def snap():
        state["g"] += next(series) * 100
        state["v"] += 100
        return {"generation_tokens": state["g"], "verify_steps": state["v"]}

    def on_drop(n, d):
        raise Interrupted(signal.SIGINT)

    from helpers.acceptance.watch import WatchSettings
    from helpers.draft.decide import threshold
    w = Watcher(WatchLog(tmp_path), snapshot=snap, clock=lambda: t.__setitem__(0, t[0] + 15.0) or t[0],
                on_drop=on_drop, settings=WatchSettings(baseline_n=5, drop_frac=0.2, material=threshold,
                                                        cooldown_s=0))
    with pytest.raises(Interrupted):
        for _ in range(40):
            w.step()
    w.log.close()
    recs = read_log(tmp_path / LOG_NAME).records
    assert [r["kind"] for r in recs][-2:] == ["drop", "investigation"]
    assert recs[-1]["verdict"] == "interrupted" and "SIGINT" in recs[-1]["error"]
