"""Interactive use in a real browser: JupyterLab started by the test on 127.0.0.1 (the repository's config, as
``make lab``), headless Chromium driven with Playwright, the live notebooks opened and run with Run All against one
embedded reference server (TP 1, to keep the test short) with the seeds' fault (draft config ids [-1, 1, 3], started like a user does:
``python -m helpers server start --detach``).

As a user would: only ``server_url`` set in 00_investigate (its run folder is new and named at the top), then the
next pages with empty ``run_dir`` (they find that run: the newest), one widget changed and its one view redrawn.
Checked: every listener of the server and of JupyterLab binds 127.0.0.1, the file browser lists each notebook once, no tab is unsaved on open, a progress block while the
investigation runs, the paths at its end, no error output and no console error, 20_acceptance's before/after, each
chart once, 03_compare on the fixed server's dump without findings, no request leaving 127.0.0.1, and no file of
another run folder (a finished one in the same outputs folder) nor of ``notebooks/`` changed (checksums).

One server for the whole module; the investigation's restart of the fixed server is the only other server start."""
from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers.investigation.propose import draft_variant
from helpers.server.process import stop_pid
from support import ROOT
from support.browser import browser, missing, watch
from support.lab import Lab, jupyterlab

pytestmark = pytest.mark.server

MODELS = ROOT / "env" / "models"
NOTEBOOKS = ROOT / "notebooks"


def _tree(folder: Path) -> dict[str, str]:
    """sha256 of every file under ``folder``, except JupyterLab's ``.ipynb_checkpoints/`` (written when a notebook is
    opened, git-ignored: not a change of a notebook or of a run)."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and ".ipynb_checkpoints" not in p.parts}


def _free_range() -> str:
    """A range of 20 ports, all free now, outside the default range: the fixed server must take its port from it."""
    from helpers.server.embedded import port_in_use

    for low in range(20100, 21900, 20):
        if not any(port_in_use(p) for p in range(low, low + 20)):
            return f"{low}-{low + 19}"
    raise AssertionError("no free range of 20 ports in 20100-21900")


def _listeners(pid: int) -> list[tuple[str, int, str]]:
    """``(address, port, process name)`` of every TCP socket listening in the process tree of ``pid``."""
    import psutil

    root = psutil.Process(pid)
    names = {p.pid: p.name() for p in [root] + root.children(recursive=True)}
    return [(c.laddr.ip, c.laddr.port, names[c.pid]) for c in psutil.net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN and c.pid in names]


def _other_run(outputs: Path) -> Path:
    """A finished run folder of another investigation, older than anything the test makes: nothing may touch it."""
    run = outputs / "20200101-000000-seeds-hunt"
    for rel, text in {"postmortem.html": "<html>other run</html>", "suite_status.json": "{}",
                      "results/01_attach.json": json.dumps({"notebook": "01_attach", "live": False, "servers": []}),
                      "investigation.json": json.dumps({"url": "http://127.0.0.1:9", "verdict": "ok"}),
                      "dumps/server-served/manifest.json": "{}",
                      "dumps/reference-server/manifest.json": "{}"}.items():
        (run / rel).parent.mkdir(parents=True, exist_ok=True)
        (run / rel).write_text(text)
    return run


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    """``(lab page driver, server URL, outputs folder, other run, timings)``; everything stopped at the end."""
    why = missing()
    if why:
        pytest.skip(why)
    if not (ROOT / "env" / "reference" / ".venv" / "bin" / "python").exists():
        pytest.skip("the SGLang reference environment is not installed (env/reference/install.sh)")
    tmp = tmp_path_factory.mktemp("lab")
    outputs, registry = tmp / "outputs", tmp / "registry"
    outputs.mkdir()
    env = {"E3F_OUTPUTS": str(outputs), "E3F_SERVER_REGISTRY": str(registry)}
    other = _other_run(outputs)
    draft = draft_variant(MODELS / "draft", {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [-1, 1, 3]}},
                          tmp / "draft")
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "helpers", "server", "start", "--draft", str(draft), "--tp", "1",
                          "--detach", "--timeout", "600", "--capture-layers", str(tmp / "layers"),
                          "--capture-ranks", str(tmp / "ranks")], cwd=ROOT, capture_output=True, text=True,
                         timeout=900, env={**os.environ, **env, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-3000:]
    url = re.search(r"ready: (http://127\.0\.0\.1:\d+)", out.stdout).group(1)
    pid = int(re.search(r"\(pid (\d+)", out.stdout).group(1))
    timings = {"server start": time.monotonic() - t0}
    try:
        # every listener of the server binds 127.0.0.1 (HTTP, ZMQ, gloo, and torch's TCPStore of the distributed init)
        listening = _listeners(pid)
        assert listening and all(ip == "127.0.0.1" for ip, _, _ in listening), listening
        with jupyterlab(tmp, env) as (base, token, lab_pid), browser() as b:
            page = b.new_page(viewport={"width": 1400, "height": 1000})
            seen = watch(page)
            yield Lab(page, base, token, lab_pid), url, outputs, other, timings, seen
    finally:
        stop_pid(pid)


def test_interactive_investigation_in_jupyterlab(session):
    lab, url, outputs, other, timings, seen = session
    other_before, notebooks_before = _tree(other), _tree(NOTEBOOKS)

    # the file browser lists each notebook once (the jupytext twins are hidden)
    lab.open("00_investigate")
    listening = _listeners(lab.pid)
    assert listening and all(ip == "127.0.0.1" for ip, _, _ in listening), listening
    names = lab.listing()
    assert sorted(n for n in names if n.endswith(".ipynb")) == sorted(p.name for p in NOTEBOOKS.glob("*.ipynb"))
    assert not [n for n in names if n.endswith(".py")], names
    assert lab.dirty() == [], "a notebook is marked unsaved as soon as it opens"

    # 00_investigate: only server_url set (docs/jupyterlab.md's live recipe), Run All
    fixed = _free_range()
    # (the acceptance budget is tested on live servers in tests/server/test_budget_live.py: left out here, 30-80 s)
    lab.set_parameters({"server_url": url, "samples": 2, "prompts": 8, "fixed_port": fixed, "acceptance_budget": False})
    progress = []
    timings["00_investigate"] = lab.run_all(timeout=400, while_running=lambda page: progress.extend(
        page.eval_on_selector_all(".e3f-progress pre", "els => els.map(e => e.textContent)")) or progress)
    print(f"server start {timings['server start']:.1f} s, 00_investigate {timings['00_investigate']:.1f} s", flush=True)
    assert lab.errors() == []
    assert progress and "attach" in progress[0], f"no progress shown while the investigation ran: {progress}"
    run = Path(lab.text(".e3f-run code")[0])
    assert run.parent == outputs and (run / "investigation.json").exists()
    where = " ".join(lab.text(".e3f-where li"))
    assert str(run / "drafts" / "proposed") in where and "python -m helpers investigate --url" in where
    assert f'run_dir = "{run}"' in where
    doc = json.loads((run / "investigation.json").read_text())
    lo, hi = (int(x) for x in fixed.split("-"))
    assert lo <= int(doc["measured"]["fixed_server"]["url"].rsplit(":", 1)[1]) <= hi, (fixed, doc["measured"])
    print("investigation timings (s):", doc["timings"], flush=True)
    assert doc["measured"]["after"]["accept_rate"] > doc["measured"]["before"]["accept_rate"]

    # the next pages: run_dir left empty, server_url set where the page takes it: they follow that run
    for nb, params in (("01_attach", {"server_url": url}), ("02_dump", {"server_url": url}),
                       ("03_compare", {"served": str(run / "dumps" / "fixed-served")}),
                       ("20_acceptance", {"server_url": url})):
        lab.open(nb)
        assert lab.dirty() == [], f"{nb} is marked unsaved as soon as it opens"
        lab.set_parameters(params)
        timings[nb] = lab.run_all(timeout=300)
        print(f"{nb}: {timings[nb]:.1f} s", flush=True)
        assert lab.errors() == [], (nb, lab.errors())
        assert lab.text(".e3f-run code")[0] == str(run), nb
        assert (run / "results" / f"{nb}.json").exists(), nb
    compared = json.loads((run / "results" / "03_compare.json").read_text())
    assert compared["verdict"] == "ok" and compared["findings"] == [], compared["findings"]

    # 20_acceptance (open): the investigation's before / after, each chart once, one widget redraws its view
    table = " ".join(lab.text(".e3f-table"))
    assert "before (as served)" in table and "after (proposed fix)" in table
    titles = [p["title"] for p in lab.page.evaluate(_PLOTS)]
    assert len(titles) == len(set(titles)), f"a chart is drawn twice: {titles}"
    assert sum(t.startswith("Per-position acceptance (all fixes)") for t in titles) == 1, titles
    select = lab.page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .widget-dropdown select").first
    t0 = time.monotonic()
    select.select_option(label="after (proposed fix)")
    lab.page.wait_for_function("() => Array.from(document.querySelectorAll('.gtitle')).some(t => "
                               "t.textContent.startsWith('Per-position acceptance (after (proposed fix))'))", timeout=30000)
    timings["widget redraw"] = time.monotonic() - t0
    titles = [p["title"] for p in lab.page.evaluate(_PLOTS)]
    assert not any(t.startswith("Per-position acceptance (all fixes)") for t in titles), titles
    assert len(titles) == len(set(titles)), titles

    # nothing else changed, nothing left the machine, no error in the console
    assert _tree(other) == other_before, "a file of another run folder changed"
    assert _tree(NOTEBOOKS) == notebooks_before, "a notebook file changed"
    assert sorted(p.name for p in outputs.iterdir()) == sorted([other.name, run.name])
    assert [u for u in seen["requests"] if not u.startswith((lab.base + "/", "blob:", "data:"))] == []
    assert seen["console_errors"] == [], seen["console_errors"]
    print("timings (s):", {k: round(v, 1) for k, v in timings.items()})


_PLOTS = """() => Array.from(document.querySelectorAll('.jp-NotebookPanel:not(.lm-mod-hidden) .js-plotly-plot'))
  .map(el => ({title: (el.querySelector('.gtitle') || {}).textContent || ''}))"""
