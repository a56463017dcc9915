"""Ablations and workload sweeps on a live embedded server (issue 23): the trained draft with its config's
``max_position_embeddings`` cut to 64, well below the 512-token prompts the context sweep sends (SGLang 0.5.23 refuses
such a draft unless ``SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1``, which is how deployments serve them; the
registry carries the variable to every restart). One TP 1 server for the module (2 cores); the toggles restart copies
of it and stop them by PID."""
from __future__ import annotations

import json
import os

import psutil
import pytest

from helpers.investigation.ablate import ablate
from helpers.investigation.live import investigate
from helpers.investigation.propose import draft_variant
from helpers.views.ablate import ablation_parts, load_ablation
from test_investigate_live import MODELS, TRAINING, server  # noqa: F401
from test_investigate_live import registry  # noqa: F401  (autouse there: state files in a temporary folder)

pytestmark = pytest.mark.server
ENV = "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN"


@pytest.fixture(scope="module")
def short_draft_server(tmp_path_factory, registry):  # noqa: F811
    tmp = tmp_path_factory.mktemp("ablate")
    draft = draft_variant(MODELS / "draft", {"max_position_embeddings": 64}, tmp / "d64")
    (draft / "training_log.json").write_text((MODELS / "draft" / "training_log.json").read_text())
    old = os.environ.get(ENV)
    os.environ[ENV] = "1"
    try:
        cm = server(tmp, draft=draft, tp=1, capture=False)
        url = cm.__enter__()
    finally:
        # the variable is gone from this process: a restart gets it from the registry entry, or fails to start
        if old is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = old
    try:
        yield url, draft
    finally:
        cm.__exit__(None, None, None)


def test_context_sweep_concurrency_sweep_and_toggles(short_draft_server, tmp_path):
    url, draft = short_draft_server
    run = tmp_path / "run"
    doc = ablate(url, run_dir=run, sweeps=["context", "concurrency"], toggles=["radix_cache_off", "cuda_graph_off"],
                 budget_s=400, num_prompts=8, max_new_tokens=32, concurrency=(1, 4))
    log = json.loads((draft / "training_log.json").read_text())["data"]["manifest"]
    assert doc["limits"]["draft"] == 64 and doc["limits"]["target"] == 512
    assert doc["limits"]["training"] == int(log["tokens"] / log["samples"])
    # the context sweep crosses the draft's configured limit and finds where acceptance really falls
    ctx = doc["sweeps"]["context"]
    measured = [p for p in ctx["points"] if not p["skipped"]]
    assert len(measured) >= 3 and max(p["max_position"] for p in measured) > 4 * 64
    t = ctx["trend"]
    assert t is not None and t["delta"] < -0.3 and t["ci"][1] < 0, t
    f = next(f for f in doc["findings"] if f["kind"] == "context_loses_acceptance")
    # acceptance still holds past position 64 (SGLang raised the draft's limit to the target's), so the tool does not
    # blame max_position_embeddings; the fall lies past the training samples' length
    assert t["past_draft_limit"] is None and t["last_ok_value"] > 64
    assert "max_position_embeddings 64 is below the context where acceptance still holds" in f["detail"]
    assert "beyond the contexts it was trained on" in f["detail"] and f["evidence"]["stage"] == "workload"
    # concurrency: the same prompts in a batch of 4 accept what they accept alone (within a tenth of a token)
    conc = doc["sweeps"]["concurrency"]
    e = conc["points"][1]["effect"]
    assert conc["trend"] is None and e["n_paired"] == 8 and abs(e["accept_length_delta"]) < 0.1, e
    # one toggle measured on a restarted copy, paired over the same prompts; one that cannot apply on CPU skipped
    radix, graph = doc["toggles"]
    assert radix["name"] == "radix_cache_off" and radix["status"] == "measured", radix
    re_ = radix["effect"]
    assert re_["n_paired"] == 8 and re_["accept_length_delta_lo"] <= re_["accept_length_delta"] <= \
        re_["accept_length_delta_hi"]
    assert "'disable_radix_cache': True" in (run / "logs" / "toggle-radix_cache_off.log").read_text()
    assert not any(p.info["cmdline"] and "toggle-radix_cache_off" in " ".join(p.info["cmdline"])
                   for p in psutil.process_iter(["cmdline"]))
    assert graph["status"] == "skipped" and "CPU" in graph["reason"]
    assert not (run / "ablate" / "toggles" / "cuda_graph_off").exists()
    assert load_ablation(run)["sweeps"]["context"]["trend"] == t
    html = "".join(p for p in ablation_parts(load_ablation(run)) if isinstance(p, str))
    assert "context_loses_acceptance" in html and "cuda_graph_off" in html and "CPU" in html

    # a budget too short for the whole sweep keeps the points it measured and lists the rest
    cut = ablate(url, run_dir=tmp_path / "cut", sweeps=["context"], toggles=["radix_cache_off"], budget_s=8,
                 num_prompts=8, max_new_tokens=32)
    pts = cut["sweeps"]["context"]["points"]
    assert pts[0]["skipped"] is None and any(p["skipped"] for p in pts[1:])
    assert cut["toggles"][0]["status"] == "skipped" and "budget" in cut["toggles"][0]["reason"]
    assert any("budget" in s for s in cut["skipped"])


def test_investigate_runs_the_context_sweep_beside_the_budget(short_draft_server, tmp_path):
    url, _ = short_draft_server
    doc = investigate(url, training=TRAINING, run_dir=tmp_path / "run", apply_fix=False, measure_prompts=8,
                      max_new_tokens=32, sweeps=["context"], sweep_budget=120)
    kinds = [f.kind for f in doc.findings]
    assert "context_loses_acceptance" in kinds, kinds
    b = doc.acceptance
    # the prompts the budget measured lose nothing: the cause stays none, the sweep is its evidence and a note
    assert b["cause"] == "none" and "workload_loses_acceptance" not in kinds, b["sentence"]
    assert b["ablation"]["workload"][0]["kind"] == "context_loses_acceptance"
    assert any("context_loses_acceptance" in n for n in b["notes"])
    assert (tmp_path / "run" / "results" / "ablate.json").exists()
