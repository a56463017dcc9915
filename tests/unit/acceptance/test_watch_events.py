"""``watch``'s lifecycle events (helpers.acceptance.lifecycle) against the in-thread fake SGLang of mode ``metrics``,
whose lifecycle fields the test sets (support.fakeserver: ``startup_time``, ``weight_version``, ``weight_load_s``,
``draft_checksum``, ``answer_shift`` / ``answer_flip``): each change is one ``event`` line naming it, a fixed-probe
answer that moves once is no event, ``--on-event check-draft`` runs the check once per sample with events and records
its verdict, ``--resume`` compares with the run's last fingerprint, bad flags are one line."""
from __future__ import annotations

from pathlib import Path

import pytest

from helpers.__main__ import main
from helpers.acceptance.lifecycle import FIXED_NEW_TOKENS, answer_key, events, fingerprint, for_server
from helpers.acceptance.watch import LOG_NAME, Watcher, WatchLog, format_line, read_log
from helpers.engines.detect import detect
from support import fakeserver

from test_watch import FRESH, metrics_server  # the in-thread fake of mode metrics, fresh counters


def test_events_between_two_fingerprints():
    a = fingerprint(server_info={"startup_time": {"load_weight": 0.04, "tokenizer_e2e": 34.5}}, model_info={"weight_version": "v1", "model_path": "/m"},
                    snapshot={"weight_load_s": None}, answer=answer_key([1, 2, 3], 2), draft_checksum="aa")
    assert events(None, a) == [] and events(a, dict(a)) == []
    b = dict(a, weight_version="v2", weight_load_s=0.8, answer=answer_key([1, 2, 4], 2), draft_checksum="bb")
    got = {e["event"]: (e["before"], e["after"]) for e in events(a, b)}
    assert got == {"weight_version_changed": ("v1", "v2"), "weights_loaded": (None, 0.8),
                   "draft_checksum_changed": ("aa", "bb"),
                   "probe_answer_changed": (answer_key([1, 2, 3], 2), answer_key([1, 2, 4], 2))}
    # a source that could not be read (None) is no event, nor one that was not read before (but the weight-load gauge)
    assert events(a, dict(a, weight_version=None, startup_time=None)) == []
    assert events(dict(a, weight_version=None), a) == []
    # a restart seen twice (startup_time and the metrics' start time) is one event
    c = dict(a, startup_time={"load_weight": 0.05, "tokenizer_e2e": 31.2}, start_time=5.0)
    assert [e["event"] for e in events(dict(a, start_time=4.0), c)] == ["server_restarted"]
    # the answer's key: token count, ids digest and verify steps; one verify step more is another answer
    assert answer_key([1, 2, 3], 2) != answer_key([1, 2, 3], 3) and answer_key([], None)["tokens"] == 0


def _watcher(url, run_dir, checksum=False, on_event=None):
    found = detect(url, deadline_s=10)
    client = found.adapter.client(url, timeout=5, retries=0)
    life = for_server(client, found.adapter, probe_timeout=5, request_timeout=5, draft_checksum=checksum)
    w = Watcher(WatchLog(run_dir), snapshot=lambda: found.adapter.watch_snapshot(client.metrics_text()),
                lifecycle=life, on_event=on_event)
    return w, client


def test_each_lifecycle_change_is_one_event_and_a_clean_server_none(tmp_path):
    with metrics_server() as url:
        m = fakeserver.METRICS
        # SGLang 0.5.23's startup_time: the start's phase durations (tokenizer_manager.py::set_startup_time)
        m.update(startup_time={"load_weight": 0.04, "tokenizer_e2e": 34.5}, weight_version="v1",
                 draft_checksum="c0" * 32)
        w, client = _watcher(url, tmp_path, checksum=True)
        clean = [w.step() for _ in range(3)]
        assert [r["events"] for r in clean] == [None, None, None]
        # the watch's own load holds the fixed probe: asked twice at the first sample (the cached answer is the ref)
        assert [r["load"]["probe_tokens"] for r in clean] == [2 * FIXED_NEW_TOKENS] + [FIXED_NEW_TOKENS] * 2
        fp = clean[-1]["lifecycle"]
        assert fp["answer"] == answer_key(range(FIXED_NEW_TOKENS), round(FIXED_NEW_TOKENS / 2.5)) and fp["errors"] == {}
        assert fp["weight_version"] == "v1" and fp["startup_time"] == {"load_weight": 0.04, "tokenizer_e2e": 34.5}
        assert fp["weight_load_s"] is None
        seen = []
        for change, event in ((dict(weight_version="v2"), "weight_version_changed"),
                              (dict(weight_load_s=1.25), "weights_loaded"),
                              (dict(weight_load_s=0.5), "weights_loaded"),
                              (dict(draft_checksum="c1" * 32), "draft_checksum_changed"),
                              (dict(answer_shift=5), "probe_answer_changed"),
                              (dict(startup_time={"load_weight": 0.05, "tokenizer_e2e": 30.1}), "server_restarted")):
            m.update(change)
            rec = w.step()
            seen.append(rec["events"])
            assert rec["events"] == [event], (change, rec["lifecycle"])
            assert w.step()["events"] is None                           # the new state is the reference now
        client.close()
    recs = read_log(tmp_path / LOG_NAME).records
    ev = [r for r in recs if r["kind"] == "event"]
    assert [e["n"] for e in ev] == [1, 2, 3, 4, 5, 6] and all(e["action"] == "record" for e in ev)
    assert ev[0]["events"] == [{"event": "weight_version_changed", "field": "weight_version", "before": "v1",
                                "after": "v2"}]
    assert ev[1]["events"][0]["before"] is None and ev[2]["events"][0]["before"] == 1.25
    assert "EVENT probe_answer_changed" in format_line(next(r for r in recs if r.get("events") == [
        "probe_answer_changed"]))


def test_a_fixed_probe_answer_that_moves_once_is_no_event(tmp_path):
    with metrics_server() as url:
        w, client = _watcher(url, tmp_path)
        w.step()
        fakeserver.METRICS["answer_flip"] = 1                          # the next answer only: not repeated
        rec = w.step()
        assert rec["events"] is None and "did not repeat" in rec["lifecycle"]["note"]
        fakeserver.METRICS["answer_flip"] = 2                          # two answers in a row: repeated, an event
        rec = w.step()
        assert rec["events"] == ["probe_answer_changed"]
        assert rec["lifecycle"]["answer"]["output_sha"] != w.step()["lifecycle"]["answer"]["output_sha"]
        client.close()


def test_on_event_runs_the_handler_once_per_sample_with_events_and_records_its_verdict(tmp_path):
    calls = []

    def on_event(n, evs, rec):
        calls.append((n, [e["event"] for e in evs], rec["i"]))
        return {"run_dir": f"check-draft-{n}", "verdict": "differs" if n == 2 else "matches"}

    with metrics_server() as url:
        m = fakeserver.METRICS
        m.update(weight_version="v1")
        w, client = _watcher(url, tmp_path, on_event=on_event)
        w.s.cooldown_s = 0.0                                           # every event checks (the cooldown: below)
        w.step()
        m.update(weight_version="v2", weight_load_s=3.0)                # two events in one sample: one check
        first = w.step()
        w.step()
        m.update(answer_shift=1)
        second = w.step()
        client.close()
    assert calls == [(1, ["weight_version_changed", "weights_loaded"], 1), (2, ["probe_answer_changed"], 3)]
    assert "-> check-draft matches" in format_line(first) and "-> check-draft differs" in format_line(second)
    recs = read_log(tmp_path / LOG_NAME).records
    kinds = [r["kind"] for r in recs]
    assert kinds == ["sample", "sample", "event", "check_draft", "sample", "sample", "event", "check_draft"]
    checks = [r for r in recs if r["kind"] == "check_draft"]
    assert [c["verdict"] for c in checks] == ["matches", "differs"] and checks[1]["run_dir"] == "check-draft-2"
    assert all(e["action"] == "check-draft" for e in recs if e["kind"] == "event")
    # the notebook page (30_watch) lists each event with the check it started
    from helpers.views.watch import load, summary_html
    data = load(tmp_path)
    assert len(data.events) == 2 and len(data.checks) == 2
    html = summary_html(data)
    assert "#1: weight_version_changed, weights_loaded -&gt; check-draft matches (check-draft-1)" in html  # escaped
    assert "#3: probe_answer_changed" in html and "check-draft differs (check-draft-2)" in html


def test_a_moving_fixed_probe_checks_once_per_cooldown_the_other_events_always(tmp_path):
    calls = []
    with metrics_server() as url:
        m = fakeserver.METRICS
        m.update(weight_version="v1")
        w, client = _watcher(url, tmp_path, on_event=lambda n, evs, rec: calls.append(n) or {"verdict": "matches"})
        w.s.cooldown_s = 3600.0
        w.step()
        for shift in (1, 2, 3):                                          # the answer moves at every sample
            m.update(answer_shift=shift)
            w.step()
        m.update(weight_version="v9")                                    # a weight version: checked all the same
        w.step()
        client.close()
    assert calls == [1, 4]
    ev = [r for r in read_log(tmp_path / LOG_NAME).records if r["kind"] == "event"]
    assert [e["action"].split(" (")[0] for e in ev] == ["check-draft", "record", "record", "check-draft"]
    assert "cooldown" in ev[1]["action"]


def test_cli_on_event_check_draft_runs_the_check_into_the_watch_run(tmp_path, monkeypatch, capsys):
    import helpers.investigation.check_draft as cd

    calls = []

    def fake_check(url, **kw):
        calls.append((url, kw))
        Path(kw["run_dir"]).mkdir()
        return {"verdict": "differs", "reason": "served_draft_differs: fake", "exit": 1, "seconds": 0.5,
                "findings": [{"kind": "served_draft_differs"}], "notes": []}

    monkeypatch.setattr(cd, "check_draft", fake_check)

    class _Sync(fakeserver.Handler):
        mode = "metrics"

        def do_GET(self):                      # a weight sync after 6 requests: a new weight version from then on
            if fakeserver.METRICS["requests"] >= 6:
                fakeserver.METRICS.update(weight_version="v2", draft_checksum="e2" * 32)
            return super().do_GET()

    fakeserver.METRICS.clear()
    fakeserver.METRICS.update(FRESH, weight_version="v1", draft_checksum="e1" * 32)
    with fakeserver.in_thread(_Sync) as url:
        rc = main(["watch", "--url", url, "--interval", "0.01", "--samples", "5", "--on-event", "check-draft",
                   "--check-timeout", "120", "--draft-checksum", "--out", str(tmp_path / "out")])
    assert rc == 0
    (run,) = (tmp_path / "out").iterdir()
    assert len(calls) == 1
    got_url, kw = calls[0]
    assert got_url == url and kw["run_dir"] == run / "check-draft-1" and kw["timeout"] == 120.0
    assert kw["previous_checksum"] == "e1" * 32                  # the checksum before the sync, not the new one
    recs = read_log(run / LOG_NAME).records
    ev = next(r for r in recs if r["kind"] == "event")
    assert [e["event"] for e in ev["events"]] == ["weight_version_changed", "draft_checksum_changed"]
    assert ev["action"] == "check-draft"
    chk = next(r for r in recs if r["kind"] == "check_draft")
    assert chk["verdict"] == "differs" and chk["findings"] == ["served_draft_differs"]
    assert chk["run_dir"] == str(run / "check-draft-1")
    assert next(r for r in recs if r["kind"] == "start")["on_event"] == "check-draft"
    err = capsys.readouterr().err
    assert "EVENT weight_version_changed, draft_checksum_changed -> check-draft differs" in err
    assert "check-draft-1: served draft differs: served_draft_differs: fake" in err


def test_resume_compares_with_the_runs_last_fingerprint(tmp_path):
    with metrics_server() as url:
        fakeserver.METRICS.update(weight_version="v1")
        assert main(["watch", "--url", url, "--interval", "0.01", "--samples", "2", "--out", str(tmp_path),
                     "--quiet"]) == 0
        (run,) = tmp_path.iterdir()
        fakeserver.METRICS.update(weight_version="v7")                  # while the watch was down
        assert main(["watch", "--resume", str(run), "--interval", "0.01", "--samples", "1", "--quiet"]) == 0
    recs = read_log(run / LOG_NAME).records
    ev = [r for r in recs if r["kind"] == "event"]
    assert len(ev) == 1 and ev[0]["events"][0]["before"] == "v1" and ev[0]["events"][0]["after"] == "v7"
    assert ev[0]["i"] == 2


def test_no_events_sends_no_lifecycle_request(tmp_path):
    with metrics_server() as url:
        assert main(["watch", "--url", url, "--interval", "0.01", "--samples", "2", "--no-events", "--probe-tokens",
                     "0", "--out", str(tmp_path), "--quiet"]) == 0
        assert fakeserver.METRICS["requests"] == 0                      # neither the probe nor the fixed probe
    (run,) = tmp_path.iterdir()
    recs = read_log(run / LOG_NAME).records
    assert all(r.get("lifecycle") is None for r in recs if r["kind"] == "sample")


@pytest.mark.parametrize("args, says", [
    (["--no-events", "--on-event", "check-draft"], "--no-events observes no lifecycle event"),
    (["--no-events", "--draft-checksum"], "--no-events observes no lifecycle event"),
    (["--check-timeout", "0"], "--check-timeout must be > 0"),
])
def test_bad_event_flags_are_one_line_exit_2(args, says, capsys):
    assert main(["watch", "--url", "http://127.0.0.1:1", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0]
