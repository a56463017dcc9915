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
    assert set(doc) == {"verdict", "findings", "served_plan", "training_plan", "ambiguity", "advisories", "inputs",
                        "draft_checks"}
    assert doc["draft_checks"]["facts"]["context_length"]["start"] == "ok"       # 2048 both: LlamaConfig's default
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


# ---------------------------------------------------------------- adversarial configs (SGLang 0.5.23 source rules)

def dsv3(folder, n=61):
    return cfg(folder, f"dsv3_{n}", {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
                                     "hidden_size": 7168, "num_hidden_layers": n, "vocab_size": 129280})


def qwen3moe(folder, n=48, h=2048):
    return cfg(folder, f"qwen3moe{n}", {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
                                        "hidden_size": h, "num_hidden_layers": n})


def test_empty_ids_crash_the_target_forward(tmp_path):
    # llama.py set_eagle3_layers_to_capture([]): layers_to_capture [] with capture_aux_hidden_states True; the model
    # returns the bare tensor and LlamaForCausalLM.forward unpacks it (ValueError); llama_eagle3.py builds fc for 3
    rep = static_check(eagle3(tmp_path, "d", []), llama(tmp_path))
    assert rep.verdict == "mismatch" and rep.served_plan.tensors == [] and "ValueError" in rep.served_plan.fatal
    assert kinds(rep) == [("server_fatal", -1)]
    f = rep.findings[0]
    assert "will not serve" in f["detail"] and "llama.py" in f["evidence"]["source"]


def test_ids_that_exist_only_as_capture_boundaries(tmp_path):
    gptoss = cfg(tmp_path, "gptoss", {"architectures": ["GptOssForCausalLM"], "hidden_size": 2880,
                                      "num_hidden_layers": 36})
    rep = static_check(eagle3(tmp_path, "go", [24, 30, 36], h=2880), gptoss)
    # out(36) cannot exist: the training plan keeps three chunks, read as boundaries, and says so
    assert rep.training_plan.tensors == rep.served_plan.tensors == ["out(23)", "out(29)", "out(35)"]
    assert rep.verdict == "ok" and rep.findings == []
    assert "capture-boundary" in rep.training_plan.notes[-1] and "capture boundaries" in rep.training_plan.source
    # DeepSeek [2, 30, 61]: index 61 is never reached -> AuxHiddenStatePacker RuntimeError: one fatal finding,
    # no layer_offset built on a dropped id
    rep = static_check(eagle3(tmp_path, "ds", [2, 30, 61], h=7168, target_hidden_size=7168), dsv3(tmp_path))
    assert rep.training_plan.tensors == ["out(1)", "out(29)", "out(60)"]
    assert kinds(rep) == [("server_fatal", -1)] and "AuxHiddenStatePacker" in rep.findings[0]["detail"]
    assert rep.verdict == "mismatch" and rep.ambiguity is None


@pytest.mark.parametrize("case", ["ds_neg", "qwen_last", "llama_old"])
def test_fatal_served_plan_gives_one_finding_and_no_layout(tmp_path, case):
    if case == "ds_neg":            # DeepSeek -1: never captured, AuxHiddenStatePacker.finalize RuntimeError
        d, t, v, needle = eagle3(tmp_path, "d", [-1, 29, 57], h=7168), dsv3(tmp_path), None, "RuntimeError"
    elif case == "qwen_last":       # qwen2_moe.py flags self.layers[48]: IndexError at start-up
        d, t, v, needle = eagle3(tmp_path, "d", [1, 23, 47], h=2048), qwen3moe(tmp_path), None, "IndexError"
    else:                           # Llama capture index 0 before 0.5.22: hidden_states + None, TypeError
        d, t, v, needle = eagle3(tmp_path, "d", [-1, 15, 28]), llama(tmp_path), "0.4.9", "TypeError"
    rep = static_check(d, t, sglang_version=v)
    assert rep.served_plan.fatal and needle in rep.served_plan.fatal
    assert kinds(rep) == [("server_fatal", -1)] and rep.verdict == "mismatch"
    detail = rep.findings[0]["detail"]
    assert detail.startswith("the server will not serve this draft") and needle in detail
    assert "silently" not in detail and "will feed" not in detail
    assert rep.findings[0]["evidence"]["source"].startswith("sglang/srt/")


def test_negative_id_wraps_on_per_layer_flag_models(tmp_path):
    # qwen2_moe.py Qwen2MoeModel.set_eagle3_layers_to_capture: setattr(self.layers[-4], ...) = layer 44 -> out(43)
    rep = static_check(eagle3(tmp_path, "d", [-5, 15, 28], h=2048), qwen3moe(tmp_path))
    assert rep.served_plan.tensors == ["out(15)", "out(28)", "out(43)"] and rep.served_plan.fatal is None
    assert not any("never reached" in f["detail"] for f in rep.findings)
    assert rep.training_plan.tensors == ["out(15)", "out(28)", "out(43)"]
    assert rep.verdict == "ambiguous" and rep.findings == []
    # llama.py tests `i in self.layers_to_capture`: -4 is never reached there
    rep = static_check(eagle3(tmp_path, "d2", [-5, 15, 28]), llama(tmp_path))
    assert rep.served_plan.tensors == ["out(15)", "out(28)"]
    assert rep.training_plan.tensors == [] and "unknown" in rep.training_plan.problems[0]["detail"]
    assert {"missing_chunk", "width_mismatch"} <= {f["kind"] for f in rep.findings}


def test_minus_one_on_llama_is_the_embedding_and_ambiguous(tmp_path):
    rep = static_check(eagle3(tmp_path, "d", [-1, 15, 28]), llama(tmp_path))
    assert rep.served_plan.tensors == ["embedding", "out(15)", "out(28)"]
    assert rep.training_plan.tensors == ["embedding", "out(15)", "out(28)"]       # three chunks, as the fc
    assert rep.verdict == "ambiguous" and rep.findings == []
    outcomes = [r["outcome"] for r in rep.ambiguity["readings"]]
    assert "exactly" in outcomes[0] and "mismatch" in outcomes[1]
    assert rep.ambiguity["readings"][1]["training"][0] == "<id -1: unknown>"


def test_top_level_ids_training_plan_matches_the_finding(tmp_path):
    rep = static_check(eagle3(tmp_path, "d", None, eagle_aux_hidden_state_layer_ids=[3, 10, 20]), llama(tmp_path))
    assert rep.training_plan.provenance == "claimed" and "top-level" in rep.training_plan.source
    assert rep.training_plan.tensors == ["out(3)", "out(10)", "out(20)"]
    assert not any("carries no layer ids" in n for n in rep.training_plan.notes)
    ignored = [f for f in rep.findings if f["kind"] == "config_ids_ignored"][0]
    assert ignored["evidence"]["meant"] == rep.training_plan.tensors
    assert rep.served_plan.tensors == ["out(1)", "out(15)", "out(28)"] and rep.verdict == "mismatch"


def test_no_aux_width_decides_fc_bypass_or_crash(tmp_path):
    t = dsv3(tmp_path)
    noaux = {"use_aux_hidden_state": False}
    # draft hidden 4096 on H = 7168: llama_eagle3.py applies fc (7168 != 4096) which takes 3 x 4096: shape error
    rep = static_check(cfg(tmp_path, "b", {"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": 4096,
                                           "eagle_config": noaux}), t)
    assert kinds(rep) == [("width_mismatch", -1)] and "shape error" in rep.findings[0]["detail"]
    assert rep.findings[0]["evidence"]["fc_in_features"] == 12288 and rep.findings[0]["evidence"]["fed_width"] == 7168
    assert not any("falls back" in a for a in rep.advisories)
    # target_hidden_size 7168: fc takes 3 x 7168 = 21504, fed 7168: a shape error too, no layout findings
    rep = static_check(cfg(tmp_path, "a", {"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": 4096,
                                           "target_hidden_size": 7168, "eagle_config": noaux}), t)
    assert kinds(rep) == [("width_mismatch", -1)] and rep.findings[0]["evidence"]["fc_in_features"] == 21504
    # draft hidden 7168 = H: fc skipped silently
    rep = static_check(cfg(tmp_path, "c", {"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": 7168,
                                           "eagle_config": noaux}), t)
    assert kinds(rep) == [("fc_bypassed", -1)]


def test_empty_sglang_version_is_bad_input(tmp_path, capsys):
    from helpers.errors import BadInput
    d, t = eagle3(tmp_path, "d", [1, 15, 28]), llama(tmp_path)
    with pytest.raises(BadInput, match="empty SGLang version"):
        static_check(d, t, sglang_version="")
    assert cli_main(["--draft-config", str(d), "--target-config", str(t), "--sglang-version", ""]) == 2
    err = capsys.readouterr().err
    assert err.startswith("diagnose: error:") and err.count("\n") == 1 and "--sglang-version" in err
