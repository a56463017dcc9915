"""helpers.acceptance.fixes in managed mode against real reference servers (one launched by
helpers.server.embedded, one by a raw launch command): each fix is measured into the ledger and its server
stopped. Fixes files, the ledger and run folders without a server: tests/unit/acceptance/test_ledger.py."""
from __future__ import annotations

import json
import os
import shlex
from pathlib import Path

import pandas as pd
import psutil
import pytest
import yaml

from helpers.server import embedded
from helpers.acceptance.fixes import FixFailed, run_fixes
from helpers.acceptance.ledger import Ledger


def _alive(pid):
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.server
def test_managed_mode_runs_each_fix_and_stops_its_server(tiny_target, tiny_draft, tmp_path):
    port = embedded.free_port()
    python = Path(os.environ.get("E3F_SGLANG_PYTHON") or embedded.DEFAULT_SGLANG_PYTHON)
    argv = embedded.build_command(python, tiny_target, draft=None, tp=1, spec=None, port=port,
                                  dtype="float32", max_total_tokens=4096, return_hidden_states=False,
                                  enable_metrics=False, forward_hooks=None, api_key=None, extra_args=())
    env = {"SGLANG_USE_CPU_ENGINE": "1", "E3F_STANDIN_AMX": "1", "TORCHDYNAMO_DISABLE": "1",
           "HF_HUB_OFFLINE": "1", "SGLANG_CPU_OMP_THREADS_BIND": embedded.cpu_bind_spec(1)}
    fixes = {
        "name": "managed test",
        "measure": {"max_new_tokens": 10, "num_prompts": 4, "n_boot": 200, "warmup": 0,
                    "ignore_eos": True},
        # the baseline goes through the raw-command path (as a GPU launch would)
        "baseline": {"command": shlex.join(argv), "url": f"http://127.0.0.1:{port}", "env": env,
                     "startup_timeout": 600},
        "fixes": [
            {"name": "clean", "launch": {"target": str(tiny_target), "draft": str(tiny_draft), "tp": 1,
                                         "spec": {"num_steps": 2, "topk": 1, "num_draft_tokens": 3},
                                         "timeout": 600}},
            {"name": "broken", "launch": {"target": str(tmp_path / "no-such-model"), "tp": 1}},
        ],
    }
    with pytest.raises(FixFailed, match=r"1 fix\(es\) failed: \['broken'\]") as err:
        run_fixes(fixes, outputs=tmp_path / "outputs", progress=False)
    run = err.value.run_dir
    assert run.parent == tmp_path / "outputs" and run.name.endswith("-managed-test")
    base = json.loads((run / "baseline.json").read_text())
    assert base["server_mode"] == "command" and base["n_requests"] == 4 and base["tok_s"] > 0
    df = Ledger(run / "ledger.parquet").read()
    assert list(df["fix"]) == ["clean", "broken"]
    clean, broken = df.iloc[0], df.iloc[1]
    assert pd.isna(clean["error"]) and "is not a directory" in broken["error"]
    assert clean["n_requests"] == 4 and clean["num_steps"] == 2 and clean["num_draft_tokens"] == 3
    assert clean["baseline_tok_s"] == pytest.approx(base["tok_s"])
    assert clean["speedup"] == pytest.approx(clean["tok_s"] / base["tok_s"])
    assert clean["accept_length_lo"] <= clean["accept_length"] <= clean["accept_length_hi"]
    assert len(json.loads(clean["positions_json"])) == 2
    # every server is gone: the launcher tree of "clean" and the raw command's tree
    for pid in (int(clean["server_pid"]), int(base["server_pid"])):
        assert not _alive(pid)
    leftovers = [p for p in psutil.process_iter(["cmdline"])
                 if str(tiny_target) in " ".join(p.info["cmdline"] or []) and _alive(p.pid)]
    assert leftovers == []
    assert (run / "fixes" / "clean" / "summary.json").exists()
    assert (run / "logs" / "baseline.log").read_text().startswith("$ ")
    html = (run / "figures.html").read_text()
    assert "<script src=" not in html and html.count("plotly.js v") == 1  # offline, embedded once
    assert html.count("Plotly.newPlot(") == 3  # by fix, positions, histogram (one num_steps: no sweep)
    assert yaml.safe_load((run / "fixes.yaml").read_text())["fixes"][0]["name"] == "clean"
