"""A draft the serving engine cannot run (issue 38 part 6: aux ids [2, 4, 4] on vLLM 0.32.0, which keeps
``sorted(set(ids))``, so the draft's fc gets 2 chunks where it takes 3 and the EngineCore dies at the first request
with HTTP 500): investigate sends no request, ends with the static check's ``server_fatal`` finding, and
``investigate --json`` prints one JSON document even when the run fails."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from helpers.budget import Budget
from helpers.engines.vllm import VLLMAdapter
from helpers.engines.vllm_rules import VLLMRules
from helpers.investigation import live
from helpers.records import InvestigationDoc

ROOT = Path(__file__).resolve().parents[3]
H64 = ROOT / "env" / "models" / "llama_h64"


def test_repeated_ids_on_vllm_end_the_run_with_one_server_fatal_finding(tmp_path):
    draft = tmp_path / "draft"
    shutil.copytree(H64 / "draft", draft)
    cfg = json.loads((draft / "config.json").read_text())
    cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [2, 4, 4]
    (draft / "config.json").write_text(json.dumps(cfg))
    rules = VLLMRules("0.32.0")
    inv = SimpleNamespace(client=None, algorithm="EAGLE3", draft_dir=draft, target_dir=H64 / "target",
                          training=H64 / "data" / "sample", rules=rules)
    lines: list[str] = []
    r = live.Run(req=None, doc=InvestigationDoc(url="http://127.0.0.1:1", run_dir=str(tmp_path), training="t"),
                 dl=Budget(60), progress=lines.append, adapter=VLLMAdapter(), rules=rules,
                 att=SimpleNamespace(version="0.32.0"))
    r.inv = inv
    r.extra = []
    with pytest.raises(live._Stopped):
        live._stage_capture(r)
    kinds = [f.kind for f in r.doc.findings]
    assert kinds[0] == "server_fatal" and r.doc.verdict == "mismatch", kinds
    f = r.doc.findings[0]
    assert "takes 3 chunks" in f.detail and "vLLM captures 2 (the ids [2, 4, 4] repeat [4]" in f.detail, f.detail
    assert "llama_eagle3.py::LlamaModel.__init__" in f.evidence["source"]
    assert r.doc.diagnosis["served_plan"]["tensors"] == ["out(1)", "out(3)"]       # in(2), in(4), once each
    assert any("none was sent" in n for n in r.doc.notes) and any("not sent: server_fatal" in x for x in lines)


def test_investigate_json_prints_json_when_the_run_fails(tmp_path):
    out = subprocess.run([sys.executable, "-m", "helpers", "investigate", "--url", "http://127.0.0.1:9",
                          "--training", str(H64 / "data" / "sample"), "--out", str(tmp_path), "--json",
                          "--timeout", "20"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out.stderr[-2000:]
    doc = json.loads(out.stdout)
    assert doc["verdict"] == "error" and "cannot connect" in doc["error"] and doc["findings"] == []
    assert "investigate: error:" in out.stderr
