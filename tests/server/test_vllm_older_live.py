"""An older vLLM release live (extended: make test-all): vLLM 0.29.0's own CPU backend from
``env/vllm/.venv-0.29.0`` (``VLLM_VERSION=0.29.0 env/vllm/install.sh``; skipped when it is absent), serving the
embedded pair env/models/llama_h64 with a copy of the trained draft whose config writes its ids ``[4, 1, 3]``.

0.29.0 holds the ids as read (``interfaces.py::EagleModelMixin._set_aux_hidden_state_layers``, where 0.30.0 on holds
``tuple(sorted(set(ids)))``) and captures by membership in layer order: the engine reports ``[4, 1, 3]``, the tool
reads the chunks ``[1, 3, 4]`` under 0.29.0's rule with no override, and the rows the draft is fed are out(0), out(2),
out(3) in that order (checked against the server's own every-layer capture of the same tokens). One server for the
module (start 2-6 min on 2 busy cores), stopped by PID at the end."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from helpers.engines.detect import detect
from helpers.engines.vllm import VLLMAdapter
from helpers.engines.vllm_server import start, venv_python
from helpers.errors import BadServerInput
from helpers.formats.dumps import read_dump

ROOT = Path(__file__).resolve().parents[2]
H64 = ROOT / "env" / "models" / "llama_h64"
VENV = ROOT / "env" / "vllm" / ".venv-0.29.0"

pytestmark = [pytest.mark.server, pytest.mark.vllm, pytest.mark.extended]
try:
    PYTHON = venv_python(VENV)
except BadServerInput:
    pytest.skip(f"{VENV.relative_to(ROOT)} is missing: build it with VLLM_VERSION=0.29.0 env/vllm/install.sh "
                "(or make setup VLLM_EXTRA=0.29.0)", allow_module_level=True)

PROMPTS = [[5, 17, 42, 99, 7, 250, 31, 8, 77, 140, 3, 61], [12, 13, 14, 15, 300, 301, 21, 9, 88]]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-0-29")
    draft = root / "draft"
    shutil.copytree(H64 / "draft", draft)
    cfg = json.loads((draft / "config.json").read_text())
    cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [4, 1, 3]
    (draft / "config.json").write_text(json.dumps(cfg))
    handle = start(H64 / "target", draft, tp=1, num_speculative_tokens=3, timeout=900, python=PYTHON,
                   log_path=root / "vllm.log")
    yield handle
    handle.stop()
    assert not handle.processes(), "a process of the vLLM 0.29.0 server survived stop()"


@pytest.fixture(scope="module")
def client(server):
    c = VLLMAdapter().client(server.url, timeout=60)
    yield c
    c.close()


def test_the_older_release_is_detected_and_its_held_ids_read_by_its_rule(server, client):
    found = detect(server.url)
    assert (found.engine, found.version) == ("vllm", "0.29.0")
    cfg = VLLMAdapter().spec_config(client)
    assert cfg.loaded["stored_aux_layer_ids"] == [4, 1, 3]                   # 0.32.0 would hold [1, 3, 4]
    assert cfg.aux_layer_ids == cfg.rule_aux_layer_ids == [1, 3, 4] and cfg.overrides == []
    assert cfg.aux_tensors == ["out(0)", "out(2)", "out(3)"]
    assert cfg.loaded["draft"]["fc_input_size"] == 3 * 128 and cfg.loaded["draft"]["embed_shared"] is True


def test_the_draft_is_fed_the_chunks_in_layer_order(client, tmp_path):
    dump = VLLMAdapter().capture_served(client, PROMPTS, tmp_path, name="served", layers=True)
    man = json.loads((dump / "manifest.json").read_text())
    assert man["engine_version"] == "0.29.0" and man["layer_plan"]["stored_ids"] == [4, 1, 3]
    assert man["layer_plan"]["tensors"] == ["out(0)", "out(2)", "out(3)"]
    ref = read_dump(tmp_path / "served-layers")
    names = ref.layer_plan["tensors"]
    assert names == ["embedding"] + [f"out({L})" for L in range(8)]
    for s, r, ids in zip(read_dump(dump).samples, ref.samples, PROMPTS):
        assert s.input_ids.tolist() == ids
        layers = r.load()
        chunk = {n: layers[:, 128 * i:128 * (i + 1)] for i, n in enumerate(names)}
        expect = torch.cat([chunk["out(0)"], chunk["out(2)"], chunk["out(3)"]], dim=-1)
        assert torch.allclose(s.load(), expect, rtol=1e-6, atol=1e-6)
        wrong = torch.cat([chunk["out(3)"], chunk["out(0)"], chunk["out(2)"]], dim=-1)   # the config's order
        assert not torch.allclose(s.load(), wrong)
