"""The config-only static check (helpers.diagnosis.static, ``python -m helpers diagnose --draft-config D
--target-config T``): verdicts ok / mismatch / ambiguous with provenance, SGLang version rules, the findings
SGLang's source implies, and the CLI's JSON and exit codes."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers.cli.diagnose import cli_main
from helpers.diagnosis.static import static_check


def cfg(folder: Path, name: str, d: dict) -> Path:
    p = folder / name
    p.mkdir(parents=True, exist_ok=True)
    (p / "config.json").write_text(json.dumps(d))
    return p


def llama(folder, n=32, h=4096):
    return cfg(folder, f"llama{n}", {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": h,
                                     "num_hidden_layers": n, "vocab_size": 128256})


def kimi(folder):
    return cfg(folder, "kimi", {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
                                "text_config": {"hidden_size": 7168, "num_hidden_layers": 61, "vocab_size": 163840}})


def eagle3(folder, name, ids=None, h=4096, arch="LlamaForCausalLMEagle3", **extra):
    d = {"architectures": [arch], "model_type": "llama", "hidden_size": h, **extra}
    if ids is not None:
        d["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True}
    return cfg(folder, name, d)


def kinds(rep):
    return sorted((f["kind"], -1 if f["chunk"] is None else f["chunk"]) for f in rep.findings)


def test_specforge_default_draft_is_ok_with_claimed_provenance(tmp_path):
    rep = static_check(eagle3(tmp_path, "d", [1, 15, 28]), llama(tmp_path))
    assert rep.verdict == "ok" and rep.findings == []
    assert rep.served_plan.tensors == rep.training_plan.tensors == ["out(1)", "out(15)", "out(28)"]
    assert rep.served_plan.provenance == "rule" and "llama.py" in rep.served_plan.source
    assert rep.training_plan.provenance == "claimed"


def test_edited_config_against_the_training_manifest(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "capture.json").write_text(json.dumps({"layer_ids": {"specforge_out_i": [1, 15, 28]}}))
    rep = static_check(eagle3(tmp_path, "d", [2, 16, 29]), llama(tmp_path), training=data)
    assert rep.verdict == "mismatch"
    assert kinds(rep) == [("config_ids_mismatch", -1), ("layer_offset", 0), ("layer_offset", 1), ("layer_offset", 2)]
    assert rep.training_plan.provenance == "manifest" and "capture.json" in rep.training_plan.source
    lo = [f for f in rep.findings if f["kind"] == "layer_offset"][0]["evidence"]
    assert lo["training_plan_provenance"] == "manifest" and lo["offset"] == 1


def test_deepseek_ids_starting_at_2_are_ambiguous_until_settled(tmp_path):
    d, t = eagle3(tmp_path, "d", [2, 30, 58], h=7168), kimi(tmp_path)
    rep = static_check(d, t)
    assert rep.verdict == "ambiguous" and rep.findings == []
    assert rep.served_plan.tensors == ["out(1)", "out(29)", "out(57)"]          # 0.5.23: capture indices, no +1
    readings = {r["training"][0]: r["outcome"] for r in rep.ambiguity["readings"]}
    assert "mismatch" in readings["out(2)"] and "exactly" in readings["out(1)"]
    assert "--trained-layer-ids" in rep.ambiguity["settle"]
    # the run's record settles it either way
    assert static_check(d, t, trained_layer_ids=[1, 29, 57]).verdict == "ok"
    settled = static_check(d, t, trained_layer_ids=[2, 30, 58])
    assert settled.verdict == "mismatch" and {f["kind"] for f in settled.findings} >= {"layer_offset"}
    # before PR 25454 (SGLang 0.5.12) DeepSeek added +1 to every id
    old = static_check(d, t, sglang_version="0.5.12")
    assert old.served_plan.tensors == ["out(2)", "out(30)", "out(58)"] and "0.5.13" in " ".join(old.served_plan.rules)


def test_deepseek_ids_starting_at_1_get_plus_one(tmp_path):
    rep = static_check(eagle3(tmp_path, "d", [1, 29, 57], h=7168), kimi(tmp_path))
    assert rep.verdict == "ok" and rep.served_plan.tensors == ["out(1)", "out(29)", "out(57)"]


def test_drafts_sglang_cannot_serve_as_eagle3(tmp_path):
    t = llama(tmp_path)
    for arch in ("DeepseekV3ForCausalLMEagle3", "GptOssForCausalLMEagle3"):
        rep = static_check(eagle3(tmp_path, arch, None, arch=arch), t)
        assert ("unsupported_draft", -1) in kinds(rep) and "not registered" in rep.findings[0]["detail"]
    plain = cfg(tmp_path, "eagle-orig", {"architectures": ["LlamaForCausalLM"], "hidden_size": 4096,
                                         "draft_vocab_size": 32000, "vocab_size": 128256})
    rep = static_check(plain, t)
    assert rep.findings[0]["kind"] == "unsupported_draft" and "LlamaForCausalLMEagle3" in rep.findings[0]["detail"]
    spec = cfg(tmp_path, "spec", {"architectures": ["Eagle3DraftModel"], "speculators_model_type": "eagle3",
                                  "eagle_aux_hidden_state_layer_ids": [2, 16, 29],
                                  "transformer_layer_config": {"hidden_size": 4096, "vocab_size": 128256}})
    rep = static_check(spec, t)
    assert ("unsupported_draft", -1) in kinds(rep) and "speculators" in rep.findings[0]["detail"]


def test_target_without_eagle3_support_and_unregistered_targets(tmp_path):
    t = cfg(tmp_path, "gpt2", {"architectures": ["GPT2LMHeadModel"], "n_embd": 768, "n_layer": 12})
    rep = static_check(eagle3(tmp_path, "d", [1, 5, 8], h=768), t)
    assert kinds(rep)[0] == ("unsupported_target", -1)
    assert rep.served_plan.fatal and "set_eagle3_layers_to_capture" in rep.served_plan.fatal


def test_field_aliases_and_text_config(tmp_path):
    longcat = cfg(tmp_path, "longcat", {"architectures": ["LongcatFlashForCausalLM"], "hidden_size": 6144,
                                        "num_layers": 28, "vocab_size": 131072})
    rep = static_check(eagle3(tmp_path, "d", None, h=6144), longcat)
    assert rep.verdict == "ok" and "num_layers" in rep.inputs["target"]
    assert rep.served_plan.tensors == ["out(1)", "out(13)", "out(24)"]          # default [2, n//2, n-3], n = 28
    assert any("falls back to" in a for a in rep.advisories)


def test_out_of_range_and_last_layer_ids(tmp_path):
    t = llama(tmp_path, n=8, h=128)
    rep = static_check(eagle3(tmp_path, "d400", [1, 3, 400], h=128), t)
    assert {"missing_chunk", "width_mismatch"} <= {f["kind"] for f in rep.findings}
    assert any("401" in f["detail"] for f in rep.findings if f["kind"] == "missing_chunk")
    qwen = cfg(tmp_path, "qwenmoe", {"architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 128,
                                     "num_hidden_layers": 8})
    rep = static_check(eagle3(tmp_path, "d7", [1, 3, 7], h=128), qwen)      # id n-1 -> layers[8]: IndexError
    assert rep.served_plan.fatal and "IndexError" in rep.served_plan.fatal
    assert rep.verdict == "mismatch"


def test_gpt_oss_boundary_ids_by_version(tmp_path):
    t = cfg(tmp_path, "gptoss", {"architectures": ["GptOssForCausalLM"], "hidden_size": 2880,
                                 "num_hidden_layers": 24})
    d = eagle3(tmp_path, "d", [12, 18, 24], h=2880)
    new = static_check(d, t, sglang_version="0.5.23")
    assert new.served_plan.tensors == ["out(11)", "out(17)", "out(23)"]       # boundaries, final one pre-norm
    old = static_check(d, t, sglang_version="0.5.16")
    assert old.served_plan.tensors == ["out(12)", "out(18)"] and old.verdict == "mismatch"


def test_cli_config_only_json_and_exit_codes(tmp_path, capsys):
    t = llama(tmp_path)
    ok = eagle3(tmp_path, "ok", [1, 15, 28])
    assert cli_main(["--draft-config", str(ok), "--target-config", str(t), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert set(doc) == {"verdict", "findings", "served_plan", "training_plan", "ambiguity", "advisories", "inputs"}
    assert doc["verdict"] == "ok" and doc["training_plan"]["provenance"] == "claimed"
    assert doc["served_plan"]["tensors"] == ["out(1)", "out(15)", "out(28)"]
    # a config file named directly: its folder's weights are not read, and the report says so
    assert cli_main(["--draft-config", str(ok / "config.json"), "--target-config", str(t)]) == 0
    assert "draft weights not read" in capsys.readouterr().out
    amb = eagle3(tmp_path, "amb", [2, 30, 58], h=7168)
    assert cli_main(["--draft-config", str(amb), "--target-config", str(kimi(tmp_path)), "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["verdict"] == "ambiguous"
    assert cli_main(["--draft-config", str(amb), "--target-config", str(kimi(tmp_path)), "--trained-layer-ids",
                     "1", "29", "57"]) == 0
    capsys.readouterr()


@pytest.mark.parametrize("argv,needle", [
    (["--draft-config", "D"], "--target-config"),
    (["--target-config", "T"], "--target-config"),
    (["--draft-config", "D", "--target-config", "T", "--sglang-version", "latest"], "version"),
    (["--served", "x.json"], "--training"),
])
def test_cli_config_only_bad_input(tmp_path, capsys, argv, needle):
    t = llama(tmp_path)
    d = eagle3(tmp_path, "d", [1, 15, 28])
    argv = [str(d) if a == "D" else str(t) if a == "T" else a for a in argv]
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("diagnose: error:") and err.count("\n") == 1 and needle in err
