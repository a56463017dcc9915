"""Workload sweeps and engine ablations (issue 23) without SGLang: a fake engine on 127.0.0.1 (tests/support/fakeserver.py
mode ``workload``) whose acceptance falls past 150 tokens of context and at temperature > 0 and does not depend on
concurrency. Every number below is measured through HTTP, the bootstrap and the paired CI, then checked against what
the fake engine does; the toggles' flags are parsed by SGLang 0.5.23's own argument parser."""
from __future__ import annotations

import json
import subprocess

import pytest

from helpers.__main__ import main
from helpers.acceptance import ablations
from helpers.acceptance.prompts import Prompt, load_prompts
from helpers.acceptance.sweeps import context_points, falls, run_sweep, trend, with_prefix
from helpers.budget import Budget
from helpers.draft.budget import join_ablation
from helpers.errors import BadInput
from helpers.investigation.ablate import ablate, sweep_finding
from helpers.server.client import SGLangClient
from helpers.server.restart import set_flags
from support import ROOT
from support.fakeserver import WORKLOAD_LIMIT, fake_server


@pytest.fixture(scope="module")
def engine():
    with fake_server("workload") as url:
        yield url


@pytest.fixture(scope="module")
def client(engine):
    c = SGLangClient(engine)
    yield c
    c.close()


PROMPTS = load_prompts(None, n=8)


def test_context_sweep_finds_the_fall_where_the_engine_puts_it(client):
    contexts = [100, 140, 200, 320]
    pts = run_sweep(client, "context", prompts=PROMPTS, max_new_tokens=16, budget=Budget(60), contexts=contexts)
    assert [p.skipped for p in pts] == [None] * 5
    ref = pts[0]
    assert ref.label.startswith("as given") and ref.effect is None
    # every point sends the same prompt ids with a longer prefix: the paired CI pairs all of them
    assert all(p.effect["n_paired"] == len(PROMPTS) for p in pts[1:])
    assert [p.value for p in pts] == sorted(p.value for p in pts)
    # the prefix was sized from the server's own token counts: each point lands near the length asked for
    for p, c in zip(pts[1:], contexts):
        assert abs(p.value - c) <= 0.15 * c, (p.label, c)
    held = [p for p in pts[1:] if p.max_position <= WORKLOAD_LIMIT]
    lost = [p for p in pts[1:] if p.prompt_tokens + 16 > WORKLOAD_LIMIT + 10]
    assert held and lost
    assert not any(falls(p, ref) for p in held)
    for p in lost:      # the fake engine takes 1.0 off every request past the limit
        assert falls(p, ref) and p.effect["accept_length_delta"] < -0.6, p.effect
    t = trend(pts, {"draft": WORKLOAD_LIMIT})
    assert t is not None and t["first_falling"] == lost[0].label and t["last_ok"] == held[-1].label
    assert t["past_draft_limit"] == WORKLOAD_LIMIT          # it holds within the limit and falls past it
    assert t["ci"][1] < 0 and t["delta"] == pytest.approx(pts[-1].effect["accept_length_delta"])
    # a limit below where acceptance still holds is not named as the place it is lost
    t64 = trend(pts, {"draft": 64})
    assert t64["past_draft_limit"] is None
    f = sweep_finding(t64, {"draft": 64, "training": 100, "sources": {"draft": "d/config.json", "training": "log"}})
    assert f["kind"] == "context_loses_acceptance" and "is not where acceptance is lost" in f["detail"]
    assert "beyond the contexts it was trained on" in f["detail"] and f["evidence"]["stage"] == "workload"
    f = sweep_finding(t, {"draft": WORKLOAD_LIMIT, "sources": {"draft": "d/config.json"}})
    assert f"begins past the draft's max_position_embeddings {WORKLOAD_LIMIT}" in f["detail"]


def test_temperature_and_concurrency_sweeps(client):
    pts = run_sweep(client, "temperature", prompts=PROMPTS, max_new_tokens=16, budget=Budget(60),
                    temperatures=(0.0, 1.0))
    assert [p.value for p in pts] == [0.0, 1.0]
    assert falls(pts[1], pts[0]) and trend(pts)["sweep"] == "temperature"
    conc = run_sweep(client, "concurrency", prompts=PROMPTS, max_new_tokens=16, budget=Budget(60),
                     concurrency=(1, 4))
    assert [p.value for p in conc] == [1, 4]
    e = conc[1].effect                      # the engine does not depend on the batch: exactly no change
    assert e["accept_length_delta"] == 0 and e["accept_length_delta_lo"] == 0 and e["accept_length_delta_hi"] == 0
    assert trend(conc) is None
    assert conc[1].summary["throughput_tok_s"] > 0


def test_a_sweep_cut_short_keeps_what_it_measured(client):
    b = Budget(60)
    pts = run_sweep(client, "concurrency", prompts=PROMPTS, max_new_tokens=16, budget=b, concurrency=(1, 2, 4),
                    progress=lambda line: b.cancel("test"))        # the budget ends once the first point is in
    # the first point was measured inside the budget and is kept; the others are listed, not measured
    assert pts[0].skipped is None and pts[0].summary["accept_length"] > 1
    assert [p.skipped for p in pts[1:]] == ["budget: 0 s left, the point needs ~0 s"] * 2, [p.skipped for p in pts]
    # a budget that runs out inside a request: that point is listed as cut short, the earlier ones are kept
    short = Budget(60)
    with SGLangClient(client.url, budget=short) as c:
        first = run_sweep(c, "temperature", prompts=PROMPTS, max_new_tokens=16, budget=short, temperatures=(0.0,))
        short.cancel("test")
        cut = run_sweep(c, "concurrency", prompts=PROMPTS, max_new_tokens=16, budget=short, concurrency=(1,))
    assert first[0].skipped is None and cut[0].skipped and cut[0].skipped.startswith("budget")
    with pytest.raises(BadInput, match="unknown sweep"):
        run_sweep(client, "batch", prompts=PROMPTS, budget=Budget(5))


def test_prefix_and_context_points():
    ps = load_prompts(None, n=3)
    longer = with_prefix(ps, ps, chars=500)
    assert [p.id for p in longer] == [p.id for p in ps]
    for a, b in zip(ps, longer):
        assert b.text.endswith("\n\n" + a.text) and len(b.text) == len(a.text) + 502 and a.text not in b.text[:500]
    toks = with_prefix([Prompt(id="t", input_ids=(5, 6, 7))], [Prompt(id="f", input_ids=(1, 2))], tokens=5)
    assert toks[0].input_ids[-3:] == (5, 6, 7) and len(toks[0].input_ids) == 8 and set(toks[0].input_ids[:5]) == {1, 2}
    pts = context_points(57, {"target": 512, "draft": 128}, max_new_tokens=32)
    assert pts == sorted(pts) and pts[-1] <= 0.9 * 512
    assert any(p < 128 for p in pts) and any(p > 128 for p in pts)          # the draft's limit is straddled
    assert all(b >= 1.3 * a for a, b in zip(pts, pts[1:])) and pts[0] >= 1.3 * 57
    assert max(context_points(57, {"target": 131072}, max_new_tokens=32)) <= 0.9 * 16384


def test_ablate_writes_once_and_its_findings_join_the_budget(engine, tmp_path, capsys):
    doc = ablate(engine, run_dir=tmp_path / "run", sweeps=["context", "concurrency"], toggles=None, budget_s=60,
                 num_prompts=6, max_new_tokens=16, contexts=[120, 260])
    saved = json.loads((tmp_path / "run" / "results" / "ablate.json").read_text())
    assert saved["sweeps"]["context"]["trend"]["first_falling"] == doc["sweeps"]["context"]["trend"]["first_falling"]
    assert [f["kind"] for f in doc["findings"]] == ["context_loses_acceptance"]
    # a fake server is in no registry and no --relaunch was given: toggles are listed as skipped, not measured
    assert doc["toggles"] == [] and any("cannot be restarted" in s for s in doc["skipped"])
    for p in doc["sweeps"]["context"]["points"]:
        assert (tmp_path / "run" / p["summary"]["saved_to"] / "per_request.parquet").exists()
    with pytest.raises(BadInput, match="already holds ablation results"):
        ablate(engine, run_dir=tmp_path / "run", sweeps=["context"], budget_s=5)
    # a budget that cannot decide stays undecided: a workload sweep says which requests lose acceptance (a note and
    # evidence), never the server's loss on the prompts measured
    b = {"cause": "undecided", "stages": [{"name": "live", "accept_length": 2.0}], "losses": {},
         "missing": ["no training log"]}
    joined = join_ablation(b, doc["findings"])
    assert joined["cause"] == "undecided" and "workload" not in joined["losses"]
    assert joined["ablation"]["workload"][0]["kind"] == "context_loses_acceptance"
    assert "context_loses_acceptance" in joined["notes"][-1]
    # no loss on the measured prompts (none) or an explained loss: the cause stays, the sweep is evidence beside it
    kept = join_ablation({"cause": "none", "stages": [], "losses": {}, "missing": []}, doc["findings"])
    assert kept["cause"] == "none" and "context_loses_acceptance" in kept["notes"][-1]
    kept = join_ablation({"cause": "draft", "stages": [], "losses": {}, "missing": []}, doc["findings"])
    assert kept["cause"] == "draft" and kept["ablation"]["workload"][0]["kind"] == "context_loses_acceptance"
    # the CLI: exit 1 on a finding, results in a new run folder, one line per bad argument
    rc = main(["ablate", "--url", engine, "--sweeps", "temperature", "--num-prompts", "4", "--max-new-tokens", "8",
               "--out", str(tmp_path / "runs"), "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 1 and [f["kind"] for f in out["findings"]] == ["temperature_loses_acceptance"]
    for bad, field in ((["--toggles", "radix"], "--toggles"), (["--concurrency", "0"], "--concurrency"),
                       (["--budget", "0"], "--budget"), (["--num-prompts", "1"], "--num-prompts")):
        assert main(["ablate", "--url", engine, "--out", str(tmp_path / "bad"), *bad]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) <= 3 and field in err[-1] and "Traceback" not in "\n".join(err), err


CPU_INFO = {"version": "0.5.23", "device": "cpu", "speculative_algorithm": "EAGLE3", "disable_radix_cache": False,
            "chunked_prefill_size": 4096, "disable_overlap_schedule": True, "disable_cuda_graph": True,
            "attention_backend": "intel_amx", "sampling_backend": "pytorch"}


def test_toggles_apply_by_version_and_device():
    skip = {t.name: t.skip_reason(CPU_INFO) for t in ablations.TOGGLES}
    assert skip["radix_cache_off"] is None and skip["chunked_prefill_off"] is None and skip["draft_off"] is None
    assert "CPU" in skip["overlap_schedule_off"] and "_disable_overlap_schedule_for_cpu" in skip["overlap_schedule_off"]
    assert "CPU" in skip["cuda_graph_off"] and "spec v2 only" in skip["spec_v1"]
    assert "already pytorch" in skip["sampling_backend_pytorch"]
    gpu = {**CPU_INFO, "device": "cuda", "disable_overlap_schedule": False, "disable_cuda_graph": False,
           "attention_backend": "fa3", "sampling_backend": "flashinfer", "disable_radix_cache": True}
    skip = {t.name: t.skip_reason(gpu) for t in ablations.TOGGLES}
    assert skip["cuda_graph_off"] is None and skip["overlap_schedule_off"] is None
    assert skip["attention_backend_triton"] is None and skip["sampling_backend_pytorch"] is None
    assert "already off" in skip["radix_cache_off"]
    assert "without a draft" in ablations.BY_NAME["draft_off"].skip_reason({**CPU_INFO, "speculative_algorithm": None})
    with pytest.raises(ValueError, match="unknown toggle 'nope'"):
        ablations.toggles(["nope"])


def test_set_flags_switches_values_and_dropping_the_draft():
    argv = ["python", "-m", "sglang.launch_server", "--model-path", "m", "--disable-radix-cache",
            "--speculative-algorithm", "EAGLE3", "--speculative-num-steps=3", "--tp", "8"]
    assert set_flags(argv, {"--chunked-prefill-size": "-1", "--disable-radix-cache": None}) == \
        ["python", "-m", "sglang.launch_server", "--model-path", "m", "--speculative-algorithm", "EAGLE3",
         "--speculative-num-steps=3", "--tp", "8", "--chunked-prefill-size", "-1", "--disable-radix-cache"]
    assert set_flags(argv, {}, drop_prefixes=("--speculative-",)) == \
        ["python", "-m", "sglang.launch_server", "--model-path", "m", "--disable-radix-cache", "--tp", "8"]


def test_every_toggle_flag_is_one_sglang_0_5_23_parses():
    py = ROOT / "env" / "reference" / ".venv" / "bin" / "python"
    if not py.exists():
        pytest.skip("the SGLang reference environment is not installed (env/reference/install.sh)")
    flags = [[k] if v is None else [k, v] for t in ablations.TOGGLES for k, v in t.flags.items()]
    code = ("import argparse, json, sys\nfrom sglang.srt.server_args import ServerArgs\n"
            "p = argparse.ArgumentParser()\nServerArgs.add_cli_args(p)\nbad = []\n"
            "for f in json.loads(sys.argv[1]):\n"
            "    try:\n        p.parse_args(['--model-path', 'm'] + f)\n"
            "    except SystemExit:\n        bad.append(f)\nprint(json.dumps(bad))\n")
    out = subprocess.run([str(py), "-c", code, json.dumps(flags)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [], out.stdout
    assert ablations.CHECKED_VERSION == "0.5.23"
