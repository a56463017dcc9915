"""The suite in live mode (what pointing it at a real TP 8 GPU server does), against one embedded
reference server that the runner starts (params ``server.managed``: TP 2, the seeds' fault injected with
``--forward-hooks``; the runner adds its per-rank and every-layer capture hooks): 00_replay is skipped (no case is
named), 00_investigate names the fault blind, 01_attach probes the server, 02_dump shows the investigation's dumps,
the hypothesis notebooks show its live verdicts, 20_acceptance measures the server into the ledger, and the
postmortem opens with the investigation's sentence. (03_compare and 12_ read the run folder the same way in both
modes: tests/suite/test_suite.py.) Slow: one server through all notebooks."""
from __future__ import annotations

import html
import json
import os
from pathlib import Path

import pytest
import yaml

from helpers.suite import runner as suite_runner

pytestmark = [pytest.mark.server, pytest.mark.slow]
LIVE = ["00_replay", "00_investigate", "01_attach", "02_dump", "10_hyp_tp_sharding", "11_hyp_embedding_allreduce",
        "20_acceptance", "99_postmortem"]


@pytest.fixture(scope="module")
def live_run(tmp_path_factory, tiny_target, tiny_draft):
    from helpers.server import embedded

    if not Path(os.environ.get("E3F_SGLANG_PYTHON") or embedded.DEFAULT_SGLANG_PYTHON).exists():
        pytest.skip("the SGLang reference environment is not installed (env/reference/install.sh)")
    from support.forensic_cases import TargetRunner, make_samples, write_specforge

    root = tmp_path_factory.mktemp("live")
    runner = TargetRunner(tiny_target)
    train = write_specforge(root / "train", runner, make_samples(runner, 2), ["out(1)", "out(3)", "out(4)"])
    params = {"name": "live", "target_dir": str(tiny_target), "draft_dir": str(tiny_draft),
              "training_data": str(train), "notebooks": LIVE,
              "server": {"managed": {"target": str(tiny_target), "draft": str(tiny_draft), "tp": 2,
                                     "faults": [{"kind": "embedding_in_place_of_layer", "chunk": 0}]}},
              "notebook_params": {"02_dump": {"num_samples": 2},
                                  "20_acceptance": {"measure_label": "live as deployed", "count": 4,
                                                    "max_new_tokens": 12}}}
    p = root / "params.yaml"
    p.write_text(yaml.safe_dump(params))
    run_dir, status = suite_runner.run_suite(p, root / "runs")
    return run_dir, status


def test_live_notebooks_run(live_run):
    run_dir, status = live_run
    failed = {nb: (e.get("ename"), e.get("evalue")) for nb, e in status["notebooks"].items() if not e["ok"]}
    assert failed == {}
    assert status["server"]["tp"] == 2 and status["server"]["url"].startswith("http://127.0.0.1:")
    assert "00_replay" in status["skipped"] and "00_replay" not in status["notebooks"]   # no silent bundled case
    inv = json.loads((run_dir / "investigation.json").read_text())
    assert inv["findings"][0]["kind"] == "embedding_in_place_of_layer", inv["findings"][:2]
    assert inv["proposed_fix"]["kind"] == "engine"                 # a hook fault: no config change fixes it
    assert inv["reference"]["how"].startswith("the server's own every-layer capture")


def test_live_attach_capture_compare(live_run):
    run_dir, _ = live_run
    attach = json.loads((run_dir / "results" / "01_attach.json").read_text())
    assert attach["live"] is True
    (srv,) = attach["servers"]
    facts = {f["setting"]: f["value"] for f in srv["facts"]}
    assert facts["TP size"] == "2" and facts["--enable-return-hidden-states"] == "True"
    assert srv["served_plan"] == ["out(1)", "out(3)", "out(4)"] and srv["static_findings"] == []
    dump = json.loads((run_dir / "results" / "02_dump.json").read_text())
    assert dump["live"] and Path(dump["captured"]["served"]).name == "server-served"
    assert (run_dir / "dumps" / "reference-server" / "manifest.json").exists()


def test_live_hypotheses_and_measurement(live_run):
    run_dir, _ = live_run
    got = {}
    for nb in ("10_hyp_tp_sharding", "11_hyp_embedding_allreduce"):
        res = json.loads((run_dir / "results" / f"{nb}.json").read_text())
        assert res["source"] == "live investigation"
        got[res["check"]] = res["results"][0]["verdict"]
    # per-rank capture on this server: every rank holds the same full-width, all-reduced states
    assert got == {"tp_sharding": "refuted", "embedding_all_reduce": "refuted"}
    acc = json.loads((run_dir / "results" / "20_acceptance.json").read_text())
    assert [r["fix"] for r in acc["fixes"]] == ["live as deployed"]
    assert (run_dir / "acceptance" / "live-as-deployed" / "summary.json").exists()
    pm = json.loads((run_dir / "results" / "99_postmortem.json").read_text())
    assert set(got) <= {v["check"] for v in pm["verdicts"]}
    assert all(v["source"].startswith("investigation") for v in pm["verdicts"])
    assert pm["headline"].startswith("What is wrong: ") and "embedding" in pm["headline"]
    page = (run_dir / "postmortem.html").read_text()
    assert html.escape(pm["story"][0]["text"], quote=False) in page and "No replay in this run folder" not in page
    assert not list((run_dir / "results").glob("replay-*.json")), "no case: nothing is replayed"
