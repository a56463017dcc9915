"""The suite runner without a server: a failing notebook is reported with its cell and error while the
others still run (exit 1), every run gets a new folder, a failed postmortem falls back to a runner page,
bad params exit 2 with a one-line reason. Notebooks come from a throw-away folder (params notebook_dir),
plus the real 99_postmortem."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import nbformat
import pytest
import yaml

from helpers.cli import suite as suite_cli
from helpers.suite import runner as suite_runner
from support import ROOT


def _notebook(cells: list[tuple[str, str]]) -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    for kind, src in cells:
        if kind == "params":
            c = nbformat.v4.new_code_cell(src)
            c.metadata["tags"] = ["parameters"]
        elif kind == "md":
            c = nbformat.v4.new_markdown_cell(src)
        else:
            c = nbformat.v4.new_code_cell(src)
        nb.cells.append(c)
    return nb


@pytest.fixture(scope="module")
def failing_params(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("failing")
    nbdir = root / "notebooks"
    nbdir.mkdir()
    params = 'run_dir = ""\nserver_url = ""\nrepo_root = ""\napi_key_env = "SGLANG_API_KEY"\n'
    nbformat.write(_notebook([("md", "# ok"), ("params", params),
                              ("code", "from pathlib import Path\n(Path(run_dir) / 'results' / 'ok.txt')"
                                       ".write_text('ran')")]), nbdir / "01_ok.ipynb")
    nbformat.write(_notebook([("md", "# fails"), ("params", params), ("code", "x = 1"),
                              ("code", "raise ValueError('boom <script>alert(1)</script>')"),
                              ("code", "print('never')")]), nbdir / "02_fail.ipynb")
    nbformat.write(_notebook([("md", "# after"), ("params", params),
                              ("code", "from pathlib import Path\n(Path(run_dir) / 'results' / 'after.txt')"
                                       ".write_text('ran')")]), nbdir / "03_after.ipynb")
    (nbdir / "99_postmortem.ipynb").write_bytes((ROOT / "notebooks" / "99_postmortem.ipynb").read_bytes())
    p = {"name": "failing", "notebook_dir": str(nbdir), "server": {"url": "http://127.0.0.1:9"},
         "notebooks": ["01_ok", "02_fail", "03_after", "99_postmortem"], "timeout_per_notebook": 300}
    (root / "params.yaml").write_text(yaml.safe_dump(p))
    return root / "params.yaml"


def test_failing_notebook_is_reported_and_the_others_run(failing_params, tmp_path, capsys):
    out = tmp_path / "runs"
    rc = suite_cli.cli_main(["run", "--params", str(failing_params), "--out", str(out)])
    assert rc == 1
    assert "1 notebook(s) failed: 02_fail" in capsys.readouterr().err
    (run_dir,) = list(out.iterdir())
    status = json.loads((run_dir / "suite_status.json").read_text())
    nbs = status["notebooks"]
    assert nbs["01_ok"]["ok"] and nbs["03_after"]["ok"] and nbs["99_postmortem"]["ok"]
    fail = nbs["02_fail"]
    assert fail["ok"] is False and fail["ename"] == "ValueError" and "boom" in fail["evalue"]
    assert fail["exec_count"] == 3 or fail["cell_index"] is not None
    assert status["failed"] == ["02_fail"]
    assert (run_dir / "results" / "ok.txt").exists() and (run_dir / "results" / "after.txt").exists()
    assert (run_dir / "html" / "02_fail.html").exists(), "a failed notebook is still exported"
    page = (run_dir / "postmortem.html").read_text()
    table = page[page.index("<th>notebook</th><th>cell</th><th>error</th>"):]
    assert 'href="html/02_fail.html"' in table and "ValueError" in table
    assert "boom &lt;script&gt;alert(1)&lt;/script&gt;" in table
    assert "<script>alert(1)" not in page
    cell = fail["exec_count"] if fail.get("exec_count") is not None else fail["cell_index"]
    assert f"<td>{cell}</td>" in table
    pm = json.loads((run_dir / "results" / "99_postmortem.json").read_text())
    assert [f["notebook"] for f in pm["failures"]] == ["02_fail"]


def test_each_run_gets_a_new_folder(failing_params, tmp_path):
    out = tmp_path / "runs"
    a, _ = suite_runner.run_suite(failing_params, out, only=["01_ok"])
    b, _ = suite_runner.run_suite(failing_params, out, only=["01_ok"])
    assert a != b and a.parent == b.parent == out
    assert (a / "params.yaml").exists() and (b / "params.yaml").exists()
    assert (a / "results" / "ok.txt").exists() and (b / "results" / "ok.txt").exists()


def test_postmortem_failure_falls_back_to_a_runner_page(failing_params, tmp_path):
    out = tmp_path / "runs"
    params = yaml.safe_load(failing_params.read_text())
    params["notebooks"] = ["02_fail"]
    p = failing_params.parent / "only-fail.yaml"
    p.write_text(yaml.safe_dump(params))
    run_dir, status = suite_runner.run_suite(p, out)
    assert status["failed"] == ["02_fail"]
    page = (run_dir / "postmortem.html").read_text()
    assert "The postmortem notebook did not complete" in page and "boom &lt;script&gt;" in page


@pytest.mark.parametrize("content, message", [
    ("name: x\n", "set case"),
    ("name: x\ncase: no/such/case.yaml\n", "field 'case'"),
    ("name: x\nserver: {url: 'http://h:1'}\nnotebooks: [no_such_notebook]\n", "field 'notebooks'"),
    ("name: x\nserver: {url: 'http://h:1'}\nunknown_field: 1\n", "unknown_field"),
    ("name: x\nserver: {url: 'http://h:1'}\nneeds: {03_compare: [02_dumb]}\n", "field 'needs': no notebook ['02_dumb']"),
    ("name: x\nserver: {url: 'http://h:1'}\nneeds: {02_dump: [03_compare]}\n",
     "field 'needs': a cycle 03_compare -> 02_dump -> 03_compare"),
    ("name: [unclosed\n", "not valid YAML"),
])
def test_bad_params_exit_2_with_one_line(tmp_path, capsys, content, message):
    p = tmp_path / "params.yaml"
    p.write_text(content)
    assert suite_cli.cli_main(["run", "--params", str(p), "--out", str(tmp_path / "runs")]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err
    assert not (tmp_path / "runs").exists() or not list((tmp_path / "runs").iterdir())


def test_given_needs_replace_only_their_own_notebooks_defaults(tmp_path):
    """A params file's ``needs`` for one notebook replaces that notebook's default; the others keep theirs."""
    from helpers.suite.params import NEEDS, load_params

    p = tmp_path / "params.yaml"
    p.write_text("name: x\nserver: {url: 'http://h:1'}\nneeds: {03_compare: []}\n")
    params = load_params(p)
    assert params.needs["03_compare"] == []
    assert params.needs["12_hyp_layer_offset"] == NEEDS["12_hyp_layer_offset"]


def test_only_with_an_unknown_notebook_exits_2_before_any_run_folder(failing_params, tmp_path, capsys):
    out = tmp_path / "runs"
    rc = suite_cli.cli_main(["run", "--params", str(failing_params), "--out", str(out),
                         "--only", "01_ok", "01_OK"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "--only" in err and "'01_OK'" in err and "01_ok" in err and "\n" not in err
    assert not out.exists() or not list(out.iterdir())


def test_kernels_running_at_once_get_their_own_ipc_sockets(tmp_path):
    """Two notebooks executed at the same time (``jobs: 2``) each talk to their own kernel: the IPC endpoints live
    in a per-kernel folder, not ``./kernel-ipc-1..5`` (where two kernels read each other's messages)."""
    import threading

    import papermill as pm

    a, b = suite_runner.IpcKernelManager(kernel_name="python3"), suite_runner.IpcKernelManager(kernel_name="python3")
    assert a.transport == b.transport == "ipc" and a.ip != b.ip and Path(a.ip).parent.is_dir()
    folder = Path(a.ip).parent
    del a
    import gc
    gc.collect()
    assert not folder.exists(), "the socket folder goes with its manager"
    results, errors = {}, []
    for i in range(2):
        nbformat.write(_notebook([("params", "tag = ''"), ("code", "import os, time\ntime.sleep(1)\npid = os.getpid()"),
                                  ("code", "print(tag, pid)")]), tmp_path / f"nb{i}.ipynb")

    def run(i):
        try:
            nb = pm.execute_notebook(str(tmp_path / f"nb{i}.ipynb"), str(tmp_path / f"out{i}.ipynb"),
                                     parameters={"tag": f"nb{i}"}, kernel_name="python3", progress_bar=False,
                                     cwd=str(tmp_path), kernel_manager_class=suite_runner.IpcKernelManager)
            results[i] = nb.cells[-1].outputs[0]["text"].split()
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)
    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert not errors, errors
    assert results[0][0] == "nb0" and results[1][0] == "nb1" and results[0][1] != results[1][1]
    assert not list(tmp_path.glob("kernel-ipc*")), "no sockets in the working directory"


def test_the_console_says_when_a_steps_sweep_cannot_tell_its_points_apart():
    """The main job's sweep (fresh clone, 2026-12-02): num_steps 2 had the highest mean tok/s, 31.6 [28.8, 34.6],
    and 3 had 29.1 [26.4, 32.1]; the page keeps 3 because the CIs overlap, and the console says so (one rule:
    helpers.acceptance.sweeps.steps_sweep_verdict) instead of 'best num_steps=2'."""
    from helpers.records import SweepStep
    from helpers.suite.runner import _sweep_line

    pts = [{"num_steps": 2, "tok_s": 31.6, "tok_s_lo": 28.8, "tok_s_hi": 34.6},
           {"num_steps": 3, "tok_s": 29.1, "tok_s_lo": 26.4, "tok_s_hi": 32.1}]
    line = _sweep_line(SweepStep(index=9, points=pts, best_num_steps=2))
    assert line == ("num_steps 2 and 3 not distinguishable: their tok/s CIs overlap (num_steps=2: 31.6 [28.8, 34.6]; "
                    "num_steps=3: 29.1 [26.4, 32.1])")
    pts[0].update(tok_s=41.6, tok_s_lo=38.8, tok_s_hi=44.6)
    assert _sweep_line(SweepStep(index=9, points=pts, best_num_steps=2)).startswith("num_steps=2 fastest, its tok/s CI")


@pytest.mark.parametrize("field, value, named", [
    ("notebooks", ["../escaped"], "field 'notebooks[0]': '../escaped' is not a notebook name"),
    ("notebooks", ["/tmp/abs"], "field 'notebooks[0]': '/tmp/abs' is not a notebook name"),
    ("notebooks", ["01_ok", ".."], "field 'notebooks[1]': '..' is not a notebook name"),
    ("notebooks", ["sub/01_ok"], "field 'notebooks[0]': 'sub/01_ok' is not a notebook name"),
    ("needs", {"01_ok": ["../x"]}, "field 'needs.01_ok': '../x' is not a notebook name"),
    ("notebook_params", {"../x": {}}, "field 'notebook_params': '../x' is not a notebook name"),
    ("common", {"run_dir": "/tmp/elsewhere"}, "field 'common.run_dir': the runner sets run_dir itself"),
    ("notebook_params", {"01_ok": {"repo_root": "/"}}, "field 'notebook_params.01_ok.repo_root'"),
    ("server", {"url": "http://user:hunter2-pw@127.0.0.1:9"}, "field 'server.url': credentials in the URL"),
    ("server", {"managed": {"extra_args": ["--host", "0.0.0.0"]}},
     "field 'server.managed.extra_args': '--host' among server.managed.extra_args sets --host"),
    # a notebook parameter is written into the executed notebook as the server's URL is (issue 40 follow-up)
    ("common", {"server_url": "http://u:hunter2-pw@127.0.0.1:9"}, "field 'common.server_url': credentials in a URL"),
    ("notebook_params", {"01_ok": {"server_url": "http://u:hunter2-pw@127.0.0.1:9"}},
     "field 'notebook_params.01_ok.server_url': credentials in a URL"),
    ("common", {"a": {"urls": ["http://127.0.0.1:9", "see https://u:hunter2-pw@h:1/v1 too"]}},
     "field 'common.a.urls[1]': credentials in a URL"),
    # 00_investigate's fixed copy is relaunched as investigate --relaunch is: the same listener rule at load
    ("notebook_params", {"00_investigate": {"relaunch": f"{sys.executable} -m sglang.launch_server --ho 0.0.0.0"}},
     "field 'notebook_params.00_investigate.relaunch': '--ho' in the launch command sets --host"),
    ("common", {"relaunch": f"{sys.executable} -m sglang.launch_server --dist-init-addr 0.0.0.0:5000"},
     "field 'common.relaunch': '--dist-init-addr' in the launch command sets --dist-init-addr"),
])
def test_names_from_a_params_file_stay_in_their_folders(failing_params, tmp_path, capsys, field, value, named):
    """Issue 40: a notebook named ``../something`` ran a notebook outside the notebook folder, wrote its executed
    copy over the source and its HTML outside the run folder. Now every name is a plain name, the runner's own
    parameters cannot be overridden, a URL's credentials and a listener flag are refused: one line naming the
    field, exit 2, no run folder, nothing written next to the notebooks or the params file."""
    outside = failing_params.parent           # holds notebooks/ (notebook_dir): "../escaped" names escaped.ipynb here
    (outside / "escaped.ipynb").write_bytes((failing_params.parent / "notebooks" / "01_ok.ipynb").read_bytes())
    before = {p: p.read_bytes() for p in outside.rglob("*") if p.is_file()}
    p = yaml.safe_load(failing_params.read_text())
    p[field] = value
    if field == "server" and "managed" in value:
        p["server"] = {"managed": {"target": str(tmp_path), "draft": None, **value["managed"]}}
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump(p))
    assert suite_cli.cli_main(["run", "--params", str(params), "--out", str(tmp_path / "runs")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith(f"suite: error: params file {params}: {named}"), err
    assert "hunter2" not in err
    assert not (tmp_path / "runs").exists()
    assert {p: p.read_bytes() for p in outside.rglob("*") if p.is_file()} == before


def test_a_run_folder_inside_the_notebook_folder_is_refused(failing_params, capsys):
    nbdir = failing_params.parent / "notebooks"
    before = sorted(nbdir.rglob("*"))
    assert suite_cli.cli_main(["run", "--params", str(failing_params), "--out", str(nbdir / "runs")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"suite: error: --out {nbdir / 'runs'}: inside the notebook folder {nbdir}; a suite run writes "
                   "nothing there (give another folder for the run folders)"), err
    assert sorted(nbdir.rglob("*")) == before
