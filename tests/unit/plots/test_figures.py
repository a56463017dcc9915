"""helpers.figures on synthetic ledger rows: the plotted values and CI bars are the ledger's, and
the HTML report renders offline (plotly.js inline, once)."""
from __future__ import annotations

import json
import re

import numpy as np
import pandas as pd
import pytest

from helpers.acceptance.stats import position_rates
from helpers.plots.acceptance import accept_length_by_fix, accept_length_histogram, all_figures, position_curves, report_html, tok_s_vs_steps, write_report


def _row(fix, al, lo, hi, tok, steps, topk=1, hist=(5, 3, 2), base=20.0, err=None):
    marg, cond = position_rates(list(hist) + [0] * (steps + 1 - len(hist)), steps)
    pos = pd.DataFrame({"position": np.arange(1, steps + 1), "marginal": marg, "marginal_lo": marg - 0.05,
                        "marginal_hi": marg + 0.05, "conditional": cond, "conditional_lo": cond - 0.1,
                        "conditional_hi": cond + 0.1})
    return {"fix": fix, "accept_length": al, "accept_length_lo": lo, "accept_length_hi": hi,
            "tok_s": tok, "tok_s_lo": tok - 1, "tok_s_hi": tok + 2, "baseline_tok_s": base,
            "num_steps": steps, "topk": topk, "ci_level": 0.95,
            "histogram_json": json.dumps(list(hist) + [0] * (steps + 1 - len(hist))),
            "positions_json": pos.to_json(orient="records"), "error": err}


LEDGER = pd.DataFrame([_row("clean", 2.4, 2.3, 2.6, 30.0, 3), _row("steps5", 2.8, 2.6, 2.9, 33.0, 5, hist=(4, 3, 2, 1)),
                       _row("topk4", 3.0, 2.9, 3.2, 28.0, 5, topk=4), _row("dead", np.nan, np.nan, np.nan, np.nan, 3,
                                                                          err="FixFailed: boom")])


def test_accept_length_by_fix_values_error_bars_and_baseline():
    fig = accept_length_by_fix(LEDGER)
    bar, tok, base = fig.data
    assert list(bar.x) == ["clean", "steps5", "topk4"]  # the failed fix is left out
    np.testing.assert_allclose(bar.y, [2.4, 2.8, 3.0])
    np.testing.assert_allclose(bar.error_y.array, [0.2, 0.1, 0.2], atol=1e-12)
    np.testing.assert_allclose(bar.error_y.arrayminus, [0.1, 0.2, 0.1], atol=1e-12)
    np.testing.assert_allclose(tok.y, [30, 33, 28])
    assert tok.yaxis == "y2" and base.yaxis == "y2" and list(base.y) == [20.0, 20.0]
    assert "95% bootstrap CI" in fig.layout.title.text


def test_position_curves_marginal_and_conditional():
    fig = position_curves(LEDGER)
    assert len(fig.data) == 6  # 3 fixes x (marginal, conditional)
    m = fig.data[0]
    np.testing.assert_allclose(m.y, [0.5, 0.2, 0.0])
    np.testing.assert_allclose(m.error_y.array, [0.05] * 3, atol=1e-12)
    assert fig.data[1].line.dash == "dash"
    assert len(position_curves(LEDGER, show="marginal").data) == 3
    with pytest.raises(ValueError):
        position_curves(LEDGER, show="x")


def test_accept_length_histogram_is_normalised_per_fix():
    fig = accept_length_histogram(LEDGER)
    assert len(fig.data) == 3
    np.testing.assert_allclose(fig.data[0].y, [0.5, 0.3, 0.2, 0.0])
    assert list(fig.data[0].x) == [1, 2, 3, 4]  # tokens per verify step = accepted + 1
    for tr in fig.data:
        assert sum(tr.y) == pytest.approx(1.0)


def test_tok_s_vs_steps_groups_by_topk():
    fig = tok_s_vs_steps(LEDGER)
    names = [t.name for t in fig.data]
    assert names[:4] == ["tok/s topk=1", "accept length topk=1", "tok/s topk=4", "accept length topk=4"]
    np.testing.assert_allclose(fig.data[0].x, [3, 5])
    np.testing.assert_allclose(fig.data[0].y, [30, 33])
    assert names[-1].startswith("baseline tok/s")


def test_report_is_offline_with_plotly_embedded_once(tmp_path):
    figs = all_figures(LEDGER)
    assert set(figs) == {"accept_length_by_fix", "position_curves", "accept_length_histogram",
                         "tok_s_vs_steps"}
    path = write_report(LEDGER, tmp_path / "r.html", title="t <x>")
    html = path.read_text()
    assert "<title>t &lt;x&gt;</title>" in html
    assert not re.search(r"<script[^>]+src=", html)  # nothing fetched from a CDN
    assert html.count("plotly.js v") == 1 and html.count("Plotly.newPlot(") == 4
    assert len(report_html([figs["position_curves"]])) > 1_000_000  # plotly.js is inline
    # an empty / all-failed ledger still renders (axes only)
    assert "Plotly.newPlot(" in report_html(all_figures(LEDGER.iloc[3:]))
