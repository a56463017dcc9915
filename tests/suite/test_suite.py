"""The whole notebook suite, end to end: papermill run folder, verdicts, figures, offline HTML, failures.

* ``suite_run`` (module fixture): a tiny case built at test time (random tiny target + EAGLE-3 draft,
  SpecForge training data from the same target) replayed by the real suite runner on the embedded
  SGLang reference server at TP 2: the seeds' fault (embedding in place of aux chunk 0, fault hooks) ->
  hypotheses in the seeds' order -> the fix (the num_steps sweep is left to the slow main-job test, to
  save a server start here; its rendering is unit-tested in tests/unit/views/test_report.py). The servers
  run with an API key read from an environment variable, so "no key in any file" is a real check. Random
  drafts accept ~1 token either way; the accept-rate jump is checked by the slow test on the trained models
  (tests/suite/test_suite_main.py).

Failures, run folders and params errors without a server: tests/unit/suite/test_suite_runner.py.
"""
from __future__ import annotations

import json
import os
import re
import secrets
import sys
import time
from pathlib import Path

import nbformat
import pytest
import yaml

from helpers.cli import suite as suite_cli
from helpers.suite import params as suite_params
from helpers.suite.html import HTML_BUDGET_BYTES, PLOTLYJS_MARKER

pytestmark = pytest.mark.server

KEY_ENV = "E3F_SUITE_TEST_API_KEY"
API_KEY = "e3f-test-key-" + secrets.token_hex(16)

CHECKS = [("embedding_all_reduce", "msg 4495", "refuted"), ("concat_order", "msg 4513", "refuted"),
          ("tp_sharding", "msg 4525", "refuted"), ("embedding_included", "chunk summary", "confirmed"),
          ("layer_offset", "", "refuted")]


def _sglang_missing() -> bool:
    from helpers.server import embedded

    py = Path(os.environ.get("E3F_SGLANG_PYTHON") or embedded.DEFAULT_SGLANG_PYTHON)
    return not py.exists()


@pytest.fixture(scope="module")
def tiny_params(tmp_path_factory, tiny_target, tiny_draft) -> Path:
    """A case file + suite params for the tiny models (training data written from the same target)."""
    from support.forensic_cases import TargetRunner, make_samples, write_specforge

    root = tmp_path_factory.mktemp("suite-case")
    runner = TargetRunner(tiny_target)
    write_specforge(root / "train", runner, make_samples(runner, 3), ["out(1)", "out(3)", "out(4)"])
    timeline = [{"fix": {"name": "as deployed", "faults": [{"kind": "embedding_in_place_of_layer", "chunk": 0}]}}]
    for check, label, expect in CHECKS:
        timeline.append({"hypothesis": {"check": check, "label": label}, "expect": expect})
    timeline += [{"fix": {"name": "revert to trained layers"}}]  # the sweep: tests/suite/test_suite_main.py
    case = {"name": "tiny-seeds", "title": "Tiny seeds hunt <b>(test)</b>",
            "models": {"target": str(tiny_target), "draft": str(tiny_draft), "training_data": str(root / "train")},
            "server": {"tp": 2}, "measure": {"count": 4, "max_new_tokens": 16, "concurrency": 2},
            "timeline": timeline}
    (root / "case.yaml").write_text(yaml.safe_dump(case, sort_keys=False))
    params = {"name": "tiny-suite", "case": "case.yaml",  # relative: resolved against the params folder
              "server": {"api_key_env": KEY_ENV}}
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    return root / "params.yaml"


@pytest.fixture(scope="module")
def suite_run(tiny_params, tmp_path_factory):
    """``(exit code, run folder, wall seconds, stdout)`` of one suite run of the tiny case."""
    if _sglang_missing():
        pytest.skip("the SGLang reference environment is not installed (env/reference/install.sh)")
    import contextlib
    import io

    out = tmp_path_factory.mktemp("runs")
    buf = io.StringIO()
    t0 = time.monotonic()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(KEY_ENV, API_KEY)
        with contextlib.redirect_stdout(buf):
            rc = suite_cli.cli_main(["run", "--params", str(tiny_params), "--out", str(out)])
    wall = time.monotonic() - t0
    runs = [p for p in out.iterdir() if p.is_dir()]
    assert len(runs) == 1, runs
    sys.stdout.write(buf.getvalue()[-3000:])
    return rc, runs[0], wall, buf.getvalue()


def test_suite_runs_every_notebook(suite_run):
    rc, run_dir, wall, stdout = suite_run
    status = json.loads((run_dir / "suite_status.json").read_text())
    failed = {nb: (e.get("ename"), e.get("evalue")) for nb, e in status["notebooks"].items() if not e["ok"]}
    assert not failed, failed
    assert rc == 0
    assert list(status["notebooks"]) == suite_params.DEFAULT_NOTEBOOKS
    for nb in suite_params.DEFAULT_NOTEBOOKS:
        assert (run_dir / "notebooks" / f"{nb}.ipynb").exists()
        assert status["notebooks"][nb]["wall_s"] >= 0
    assert (run_dir / "params.yaml").exists()
    assert "helpers suite run --params" in (run_dir / "command.txt").read_text()
    # progress: each replay step printed while 00_replay ran
    assert "replay step 1: fix as deployed" in stdout
    assert "embedding_included: confirmed" in stdout


def test_recorded_verdicts_match_the_case(suite_run):
    _, run_dir, _, _ = suite_run
    doc = json.loads((run_dir / "results" / "replay-tiny-seeds.json").read_text())
    assert doc["complete"] is True
    got = [(s["check"], s["verdict"]) for s in doc["steps"] if s["kind"] == "hypothesis"]
    assert got == [(c, v) for c, _, v in CHECKS]
    assert all(s["as_expected"] for s in doc["steps"] if s["kind"] == "hypothesis")
    assert [s["name"] for s in doc["steps"] if s["kind"] == "fix"] == ["as deployed", "revert to trained layers"]
    assert "embedding" in doc["headline"] and "embedding_included" in doc["headline"]
    # the notebooks' own results
    pm = json.loads((run_dir / "results" / "99_postmortem.json").read_text())
    assert [(v["check"], v["verdict"]) for v in pm["verdicts"]] == got
    assert pm["headline"] == doc["headline"]
    assert len(pm["before_after"]) == 3 and not pm["failures"]
    cmp_ = json.loads((run_dir / "results" / "03_compare.json").read_text())
    assert cmp_["verdict"] == "mismatch"
    assert "embedding_in_place_of_layer" in [f["kind"] for f in cmp_["findings"]]
    assert cmp_["chunks"][0]["identified_as"] == "embedding"
    for nb, check in (("10_hyp_tp_sharding", "tp_sharding"), ("11_hyp_embedding_allreduce", "embedding_all_reduce"),
                      ("12_hyp_layer_offset", "layer_offset")):
        res = json.loads((run_dir / "results" / f"{nb}.json").read_text())
        assert res["source"] == "replay" and res["check"] == check
        assert [r["verdict"] for r in res["results"]] == [v for c, _, v in CHECKS if c == check]
    attach = json.loads((run_dir / "results" / "01_attach.json").read_text())
    assert [s["fix"] for s in attach["servers"]] == ["as deployed", "revert to trained layers"]
    assert attach["servers"][0]["served_plan"] == ["out(1)", "out(3)", "out(4)"]


def test_run_folder_holds_figures_dumps_ledger(suite_run):
    _, run_dir, _, _ = suite_run
    figs = sorted(p.name for p in (run_dir / "figures").glob("step*.json"))
    assert any("embedding_all_reduce" in f for f in figs) and any("layer_offset" in f for f in figs), figs
    for f in (run_dir / "figures").glob("*.json"):
        assert json.loads(f.read_text())["data"], f
    assert (run_dir / "ledger.parquet").exists()
    assert (run_dir / "dumps" / "as-deployed-served" / "manifest.json").exists()
    assert (run_dir / "dumps" / "reference-hf" / "manifest.json").exists()
    for fix in ("as-deployed", "revert-to-trained-layers"):
        summary = json.loads((run_dir / "acceptance" / fix / "summary.json").read_text())
        assert summary["summary"]["n_requests"] == 4
    acc = json.loads((run_dir / "results" / "20_acceptance.json").read_text())
    assert [r["fix"] for r in acc["fixes"]] == ["as deployed", "revert to trained layers"]
    assert acc["sweep"] == []


def _plotly_figures_in(nb_path: Path) -> int:
    nb = nbformat.read(nb_path, as_version=4)
    return sum(1 for c in nb.cells for o in c.get("outputs", [])
               if "application/vnd.plotly.v1+json" in (o.get("data") or {}))


def test_html_pages_are_offline_and_embed_plotly_once(suite_run):
    _, run_dir, _, _ = suite_run
    status = json.loads((run_dir / "suite_status.json").read_text())
    pages = [run_dir / "postmortem.html"] + [run_dir / "html" / f"{nb}.html" for nb in suite_params.DEFAULT_NOTEBOOKS[:-1]]
    for page in pages:
        text = page.read_text()
        assert not re.search(r"<script[^>]*\bsrc\s*=\s*[\"']?\s*(https?:)?//", text, re.I), page
        assert not re.search(r"<link[^>]*\bhref\s*=\s*[\"']?\s*(https?:)?//", text, re.I), page
        assert text.count(PLOTLYJS_MARKER) == 1, page
        assert "require.js" not in text and "MathJax.js" not in text
        assert "VBox(children" not in text, f"{page}: a widget's text fallback leaked into the page"
    for nb in ("00_replay", "03_compare", "20_acceptance", "99_postmortem"):
        assert _plotly_figures_in(run_dir / "notebooks" / f"{nb}.ipynb") >= 2, nb
    assert status["postmortem_check"]["offline"] is True
    size = (run_dir / "postmortem.html").stat().st_size
    assert status["postmortem_bytes"] == size < HTML_BUDGET_BYTES
    print(f"postmortem.html: {size / 1e6:.2f} MB (budget {HTML_BUDGET_BYTES / 1e6:.0f} MB)")


def test_postmortem_page_content(suite_run):
    from bs4 import BeautifulSoup

    _, run_dir, _, _ = suite_run
    text = (run_dir / "postmortem.html").read_text()
    pm = json.loads((run_dir / "results" / "99_postmortem.json").read_text())
    soup = BeautifulSoup(text, "html.parser")
    # the first screen: one headline in three parts with sources, then one before / after table with CIs
    heads = soup.select(".e3f-headline")
    assert len(heads) == 1, "one headline"
    parts = heads[0].select(".e3f-hl-part")
    assert [p.b.get_text() for p in parts] == ["What is wrong:", "The fix:", "Measured effect:"]
    for p, rec in zip(parts, pm["story"]):
        assert rec["text"] in p.get_text() and p.select_one(".e3f-src").get_text() == f"source: {rec['source']}"
    assert text.index("e3f-headline") < text.index("Verdicts"), "the headline comes first"
    first = soup.select_one(".e3f-first")
    rows = {tr.td.get_text(): [td.get_text() for td in tr.select("td")] for tr in first.select("table tr") if tr.td}
    assert list(rows) == ["accept rate", "accept length", "tok/s"]
    assert [r["metric"] for r in pm["before_after"]] == list(rows)
    assert all("[" in rows[m][1] and "[" in rows[m][2] for m in rows), rows     # 95% CIs before and after
    flagged = [li.get_text() for li in first.select(".e3f-flags li")]
    assert bool(rows["tok/s"][-1]) == any(f.startswith("tok/s: ") for f in flagged), (rows["tok/s"], flagged)
    assert [f["text"] for f in pm["flags"]] == [f.split(": ", 1)[1] for f in flagged]
    assert "embedding_included" in text and "confirmed" in text and "refuted" in text
    assert "Tiny seeds hunt &lt;b&gt;(test)&lt;/b&gt;" in (run_dir / "html" / "00_replay.html").read_text(), \
        "case text is escaped"
    for nb in suite_params.DEFAULT_NOTEBOOKS[:-1]:
        assert f'href="html/{nb}.html"' in text
        assert (run_dir / "html" / f"{nb}.html").exists()
    assert "All notebooks before this one ran without error" in text


def test_no_api_key_anywhere_in_the_run_folder(suite_run):
    _, run_dir, _, _ = suite_run
    # the key was really in use: the replay's servers ran with --api-key (redacted in their logs)
    logs = "".join(p.read_text(errors="replace") for p in (run_dir / "logs").glob("*.log"))
    assert "--api-key" in logs
    needle = API_KEY.encode()
    hits = [str(p.relative_to(run_dir)) for p in run_dir.rglob("*") if p.is_file() and needle in p.read_bytes()]
    assert hits == []


def test_postmortem_renders_in_headless_chromium(suite_run):
    from support.browser import find_chromium, render_page

    if find_chromium() is None:
        pytest.skip("chromium is not installed (apt-get install chromium; .ci/run installs it)")
    _, run_dir, _, _ = suite_run
    shot = run_dir / "postmortem.png"
    r = render_page(run_dir / "postmortem.html", screenshot=shot)
    assert len(r["plots"]) >= 2, r["plots"]
    assert all(p["svg_children"] > 20 and p["width"] > 100 and p["height"] > 100 for p in r["plots"]), r["plots"]
    assert r["console_errors"] == []
    assert r["requests"] == [], "the page must not touch the network"
    assert shot.exists() and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000
    for nb in ("00_replay", "03_compare"):
        r = render_page(run_dir / "html" / f"{nb}.html")
        assert r["plots"] and all(p["svg_children"] > 20 for p in r["plots"]), (nb, r["plots"])
        assert r["console_errors"] == [] and r["requests"] == [], nb
