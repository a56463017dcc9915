"""The 30_watch page's logic (helpers.views.watch) on a watch log written by the real sampler: the figures hold the
series, the change point's CI band and the drop; a torn line is counted, not fatal; the newest watch run is found."""
from __future__ import annotations

import pytest

from helpers.acceptance.watch import LOG_NAME, Watcher, WatchLog, WatchSettings
from helpers.draft.decide import threshold
from helpers.errors import BadInput
from helpers.views import watch as V


def _run(run_dir):
    series = [2.5] * 12 + [1.6] * 12
    st = {"i": 0, "g": 0.0, "v": 0.0}
    t = [1_700_000_000.0]

    def snap():
        st["g"] += series[st["i"]] * 100
        st["v"] += 100
        st["i"] += 1
        return {"generation_tokens": st["g"], "verify_steps": st["v"], "kv_cache_use": 0.2 + 0.5 * (st["i"] > 12),
                "running_reqs": 4.0}

    def clock():
        t[0] += 15.0
        return t[0]

    w = Watcher(WatchLog(run_dir), snapshot=snap, clock=clock,
                settings=WatchSettings(baseline_n=5, drop_frac=0.2, material=threshold))
    for _ in range(24):
        w.step()
    w.log.close()
    with open(run_dir / LOG_NAME, "ab") as fh:
        fh.write(b'{"kind": "sam')


def test_the_page_draws_the_series_the_change_and_the_drop(tmp_path):
    _run(tmp_path)
    data = V.load(tmp_path)
    assert len(data.samples) == 24 and data.skipped == 1 and len(data.drops) == 1
    assert data.samples["accept_length"].iloc[5] == pytest.approx(2.5)
    assert data.last_change["before"] == pytest.approx(2.5) or data.last_change["after"] == pytest.approx(1.6)
    summary, fig, cov = V.parts(data)
    assert "kv_cache_use" in summary and "lines skipped" in summary
    names = [tr.name for tr in fig.data]
    assert any(n.startswith("accept length (counters)") for n in names) and "mean before" in names
    assert len(fig.layout.shapes) >= 2                      # the CI band and the change line (and the drop)
    band = fig.layout.shapes[0]
    assert band.type == "rect" and band.x0 <= band.x1
    assert [tr.name for tr in cov.data][:3] == ["KV-cache use", "cache hit rate", "running requests"]


def test_newest_watch_run_and_a_folder_that_is_not_one(tmp_path, monkeypatch):
    (tmp_path / "20260101-000000-watch").mkdir()
    _run(tmp_path / "20260101-000000-watch")
    (tmp_path / "20270101-000000-other").mkdir()
    monkeypatch.setenv("E3F_OUTPUTS", str(tmp_path))
    assert V.newest_watch_run() == tmp_path / "20260101-000000-watch"
    with pytest.raises(BadInput, match="no watch.jsonl"):
        V.resolve(tmp_path / "20270101-000000-other")


def test_the_span_reads_as_a_duration():
    """The summary's span (a pandas Timedelta printed itself as ``0 days 00:00:49.958356858``, the fresh-user run)."""
    import pandas as pd
    assert V._span(pd.Timedelta(seconds=49.958356858)) == "50.0 s"
    assert V._span(pd.Timedelta(seconds=3723.4)) == "1h02m03s"
