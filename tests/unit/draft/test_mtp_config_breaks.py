"""Config-only MTP checks on inputs nobody wrote (the breaker's reproducers of the MTP config checks, rebuilt here
small): field types and bounds the head's expansion reads, Qwen3.5's layer count at the top level, a DeepSeek config
without ``num_hidden_layers``, an index naming only ``.bias`` tensors, MiMo checkpoints with more MTP layers than
declared."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from helpers.__main__ import main
from helpers.draft.mtp_checks import MTPSpec, check_mtp, missing_tensors
from helpers.engines.vllm_rules import VLLMMTPRules
from helpers.layers.mtp import MAX_EXPERTS, deepseek_nextn_shapes, mtp_head
from support import DATA
from support.mtp_folders import config_folder

PUB = DATA / "public_configs" / "aiconfigurator"
DS = json.loads((PUB / "deepseek-ai--DeepSeek-V3_config.json").read_text())
#: the breaker's small DeepSeek config (repro/idx/*: hidden 8, 2 experts, 2 decoder layers)
SMALL_DS = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "num_hidden_layers": 2,
            "hidden_size": 8, "num_attention_heads": 2, "q_lora_rank": 4, "kv_lora_rank": 4, "qk_nope_head_dim": 2,
            "qk_rope_head_dim": 2, "v_head_dim": 2, "n_routed_experts": 2, "moe_intermediate_size": 4,
            "n_shared_experts": 1, "num_nextn_predict_layers": 1, "vocab_size": 16, "tie_word_embeddings": False}


def _diagnose(d: Path, engine: str, *extra: str) -> int:
    return main(["diagnose", "--draft-config", str(d), "--target-config", str(d), "--engine", engine, *extra])


# ------------------------------------------------------------------------------------------------ B1: sizes

@pytest.mark.parametrize("field,value", [
    ("n_routed_experts", 10 ** 9), ("n_routed_experts", -5), ("n_routed_experts", 2.5), ("n_routed_experts", "256"),
    ("hidden_size", "7168"), ("hidden_size", -1), ("moe_intermediate_size", -1), ("num_hidden_layers", 10 ** 30)])
@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_a_size_the_head_expansion_reads_is_exit_2_in_bounded_time(tmp_path, capsys, field, value, engine):
    """Before: 1e9 experts hung building one name per expert; -5 / 2.5 / '7168' were dropped and vLLM said ok."""
    d = config_folder(tmp_path, "t", DS, **{field: value})
    t0 = time.monotonic()
    rc = _diagnose(d, engine)
    err = capsys.readouterr().err.strip()
    assert time.monotonic() - t0 < 20
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert f"[{field}]" in err and "expected an integer" in err and str(d / "config.json") in err, err
    if field == "n_routed_experts":
        assert f"1-{MAX_EXPERTS}" in err and "this tool's bound" in err, err


def test_the_expansion_itself_refuses_an_expert_count_over_the_bound():
    """``deepseek_nextn_shapes`` (also reached through ``mtp_head`` without the reader's checks) never lists more
    than MAX_EXPERTS experts; at the bound it lists 3 per expert."""
    with pytest.raises(ValueError, match="n_routed_experts"):
        deepseek_nextn_shapes({**DS, "n_routed_experts": MAX_EXPERTS + 1})
    assert mtp_head({**DS, "n_routed_experts": 10 ** 9}).expected == ()
    names = deepseek_nextn_shapes({**DS, "n_routed_experts": MAX_EXPERTS})
    assert sum(".mlp.experts." in n for n in names) == 3 * MAX_EXPERTS


# ------------------------------------------------------------------------------------- B2: Qwen3.5 top level

def _q35(tmp: Path, name: str, top, text) -> Path:
    cfg = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
           "text_config": {"num_hidden_layers": 64, "hidden_size": 5120}}
    if top is not None:
        cfg["mtp_num_hidden_layers"] = top
    if text is not None:
        cfg["text_config"]["mtp_num_hidden_layers"] = text
    return config_folder(tmp, name, cfg)


def test_qwen35_layer_count_at_the_top_level_is_read_as_vllm_reads_it(tmp_path):
    """vLLM's hf_config_override reads the top-level mtp_num_hidden_layers first, then text_config's (before: only
    text_config's, so a top-level 2 gave a wrong mtp_head_refused); its head class builds text_config's count
    (default 1), so n_predict 2 over 1 built layer reruns it."""
    d = _q35(tmp_path, "top", 2, None)
    rep = check_mtp(d, d, rules=VLLMMTPRules())
    kinds = [f["kind"] for f in rep.findings]
    assert "mtp_head_refused" not in kinds, rep.findings
    loads = rep.draft_checks["facts"]["loads"]
    assert loads["n_predict"] == 2 and loads["layers_loaded"] == 1
    assert "mtp_steps_beyond_head" in kinds
    both = _q35(tmp_path, "both", 3, 1)                # both given and different: the top level wins on vLLM
    assert check_mtp(both, both, rules=VLLMMTPRules()).draft_checks["facts"]["loads"]["n_predict"] == 3
    text = _q35(tmp_path, "text", None, 2)             # the usual form keeps its result
    loads = check_mtp(text, text, rules=VLLMMTPRules()).draft_checks["facts"]["loads"]
    assert loads["n_predict"] == 2 and loads["layers_loaded"] == 2
    sg = check_mtp(d, d)                               # SGLang builds one layer whatever; its note quotes the 2
    assert sg.draft_checks["facts"]["head"]["layers"] == 2
    assert any("mtp_num_hidden_layers is 2, but SGLang builds 1" in n for n in sg.advisories)


def test_qwen35_top_level_count_of_the_wrong_type_is_exit_2(tmp_path, capsys):
    d = _q35(tmp_path, "bad", "2", 1)
    assert _diagnose(d, "vllm") == 2
    err = capsys.readouterr().err.strip()
    assert "[mtp_num_hidden_layers]" in err and len(err.splitlines()) == 1, err


# --------------------------------------------------------------------------- B3: num_hidden_layers absent

def test_deepseek_without_num_hidden_layers_takes_the_config_class_default(tmp_path):
    """DeepseekV3Config's num_hidden_layers = 61 (transformers 5.19, l. 86): the head is model.layers.61. (before:
    model.layers.0.), with a note saying the default applies."""
    d = config_folder(tmp_path, "d", DS, num_hidden_layers=None)
    for rules in (None, VLLMMTPRules()):
        rep = check_mtp(d, d, rules=rules)
        assert rep.draft_checks["facts"]["loads"]["prefixes"] == ["model.layers.61."]
        assert any("num_hidden_layers is not in the config: the config class's default 61" in n
                   for n in rep.advisories)


def test_a_null_num_hidden_layers_is_exit_2_not_layer_0(tmp_path, capsys):
    d = config_folder(tmp_path, "n", DS)
    (d / "config.json").write_text(json.dumps({**DS, "num_hidden_layers": None}))
    assert _diagnose(d, "vllm") == 2
    err = capsys.readouterr().err.strip()
    assert "[num_hidden_layers]" in err and "got null" in err and len(err.splitlines()) == 1, err


def test_a_family_whose_prefix_needs_num_hidden_layers_without_a_default_is_refused(tmp_path, capsys):
    cfg = {"architectures": ["Step3p5ForCausalLM"], "num_nextn_predict_layers": 1, "hidden_size": 8}
    d = config_folder(tmp_path, "s", cfg)
    assert _diagnose(d, "sglang") == 2
    err = capsys.readouterr().err.strip()
    assert "[num_hidden_layers]" in err and len(err.splitlines()) == 1, err


# --------------------------------------------------------------------------------- B5: bias-only index

def test_bias_tensors_do_not_stand_for_the_heads_weights(tmp_path):
    """An index naming only .bias tensors of the head (the breaker's ds_bias_only) is a missing head on both
    engines (before: ok); a quantised checkpoint's qweight / weight_packed still stands for the weight, a lone
    weight_scale does not."""
    exp = tuple(n.split(".", 3)[3] for n in deepseek_nextn_shapes(SMALL_DS))
    bias = [f"model.layers.2.{n[:-len('.weight')]}.bias" for n in exp if n.endswith(".weight")]
    d = config_folder(tmp_path, "b", SMALL_DS, index=bias)
    for rules in (None, VLLMMTPRules()):
        rep = check_mtp(d, d, spec=MTPSpec(num_steps=1, topk=1), rules=rules)
        miss = [f for f in rep.findings if f["kind"] == "mtp_weights_missing"]
        assert miss and rep.verdict == "mismatch"
        assert "model.layers.2.eh_proj.weight" in miss[0]["evidence"]["missing"]["model.layers.2."]
    p = "model.layers.2."
    assert missing_tensors([p], ("eh_proj.weight",), (), {p + "eh_proj.qweight"}) == {}
    assert missing_tensors([p], ("eh_proj.weight",), (), {p + "eh_proj.weight_packed"}) == {}
    assert missing_tensors([p], ("eh_proj.weight",), (), {p + "eh_proj.weight_scale"}) == {p: [p + "eh_proj.weight"]}
    assert missing_tensors([p], ("eh_proj.weight",), (), {p + "eh_proj.bias"}) == {p: [p + "eh_proj.weight"]}


# ------------------------------------------------------------------------- B4: MiMo layers past the first

_MIMO_T = ("token_layernorm.weight", "hidden_layernorm.weight", "input_proj.weight", "final_layernorm.weight",
           "input_layernorm.weight", "post_attention_layernorm.weight")
_MIMO_V2_T = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "final_layernorm.weight", "input_layernorm.weight",
              "pre_mlp_layernorm.weight")


def _mimo(tmp: Path, name: str, declared: int, layers: range, v2: bool = False) -> Path:
    arch, p, ts = ("MiMoV2FlashForCausalLM", "model.mtp.layers.", _MIMO_V2_T) if v2 else \
        ("MiMoForCausalLM", "model.mtp_layers.", _MIMO_T)
    cfg = {"architectures": [arch], "num_hidden_layers": 2, "num_nextn_predict_layers": declared, "hidden_size": 8}
    return config_folder(tmp, name, cfg, index=[f"{p}{i}.{t}" for i in layers for t in ts])


def test_mimo_layers_past_the_first_are_never_ok_on_sglang_and_refused_past_the_declared_on_vllm(tmp_path):
    """The breaker's mimo_3layers (3 declared, layers 0-2, 1 step) and mimo_extra_layer (1 declared, layers 0-1):
    before, ok on both engines. SGLang folds every model.mtp_layers.<i> into its one block (the last read is served):
    mtp_layer_folded; vLLM remaps i < declared only and AutoWeightsLoader raises ValueError on layer 1."""
    one_step = MTPSpec(num_steps=1, topk=1)
    three = _mimo(tmp_path, "three", 3, range(3))
    sg = check_mtp(three, three, spec=one_step)
    f = [x for x in sg.findings if x["kind"] == "mtp_layer_folded"]
    assert sg.verdict == "mismatch" and f and f[0]["evidence"]["checkpoint_layers"] == [0, 1, 2]
    assert check_mtp(three, three, spec=one_step, rules=VLLMMTPRules()).verdict == "ok"  # 3 built, step 1 reads 0
    extra = _mimo(tmp_path, "extra", 1, range(2))
    assert [x["kind"] for x in check_mtp(extra, extra, spec=one_step).findings] == ["mtp_layer_folded"]
    vl = check_mtp(extra, extra, spec=one_step, rules=VLLMMTPRules())
    ref = [x for x in vl.findings if x["kind"] == "mtp_head_refused"]
    assert ref and ref[0]["evidence"]["unmapped"] == [1] and "model.mtp_layers.1" in ref[0]["detail"]
    assert "ValueError" in ref[0]["detail"]
    only0 = _mimo(tmp_path, "only0", 1, range(1))    # the released layout keeps its result
    assert check_mtp(only0, only0, spec=one_step).verdict == "ok"
    assert check_mtp(only0, only0, spec=one_step, rules=VLLMMTPRules()).verdict == "ok"


def test_mimo_v2_folds_on_sglang_and_skips_on_vllm(tmp_path):
    """MiMo-V2: SGLang's map_model_name_to_mtp_param_name folds model.mtp.layers.<i> likewise (finding); vLLM builds
    layer 0 only and its load_weights skips names outside its parameters (a note, no refusal)."""
    d = _mimo(tmp_path, "v2", 1, range(2), v2=True)
    one_step = MTPSpec(num_steps=1, topk=1)
    assert "mtp_layer_folded" in [x["kind"] for x in check_mtp(d, d, spec=one_step).findings]
    vl = check_mtp(d, d, spec=one_step, rules=VLLMMTPRules())
    assert "mtp_head_refused" not in [x["kind"] for x in vl.findings]
    assert any("MTP layers [0, 1]" in n and "not loaded" in n for n in vl.advisories)


# ------------------------------------------------------------------------------------------------- minor

@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_an_empty_architecture_name_is_exit_2(tmp_path, capsys, engine):
    """['', 'DeepseekV3ForCausalLM'] was read as DeepSeek (the empty name skipped) where the engines read
    architectures[0] == ''."""
    d = config_folder(tmp_path, "e", DS, architectures=["", "DeepseekV3ForCausalLM"])
    assert _diagnose(d, engine) == 2
    err = capsys.readouterr().err.strip()
    assert "[architectures]" in err and "non-empty" in err and len(err.splitlines()) == 1, err


def test_a_head_declared_with_0_layers_is_never_ok_without_its_tensor_names(tmp_path):
    """MiMo-V2 with num_nextn_predict_layers 0: both engines build one head layer anyway (vLLM writes n_predict 1
    whatever the config says); without the index the verdict is ambiguous (exit 1), with an index holding layer 0
    the weights check decides."""
    cfg = {"architectures": ["MiMoV2FlashForCausalLM"], "num_hidden_layers": 48, "num_nextn_predict_layers": 0}
    d = config_folder(tmp_path, "z", cfg)
    one_step = MTPSpec(num_steps=1, topk=1)
    for rules in (None, VLLMMTPRules()):
        rep = check_mtp(d / "config.json", d / "config.json", spec=one_step, rules=rules)
        assert rep.verdict == "ambiguous" and any("undecided" in n for n in rep.advisories), rep.verdict
    full = _mimo(tmp_path, "zfull", 0, range(1), v2=True)
    assert check_mtp(full, full, spec=one_step, rules=VLLMMTPRules()).verdict == "ok"


def test_nan_in_both_lm_head_copies_is_named(tmp_path):
    """A NaN in the head's own shared_head.head and in the target's lm_head was reported as 'differs (shape ...)'."""
    import torch
    from safetensors.torch import save_file
    d = config_folder(tmp_path, "n", SMALL_DS)
    w = torch.randn(16, 8)
    w[3, 4] = float("nan")
    tensors = {"lm_head.weight": w.clone(), "model.embed_tokens.weight": torch.randn(16, 8),
               "model.layers.2.shared_head.head.weight": w.clone()}
    tensors.update({k: torch.ones(s) for k, s in deepseek_nextn_shapes(SMALL_DS).items()})
    save_file(tensors, str(d / "model.safetensors"))
    rep = check_mtp(d, d, spec=MTPSpec(num_steps=1, topk=1))
    f = [x for x in rep.findings if x["kind"] == "lm_head_replaced"]
    assert f and "NaN" in f[0]["detail"] and "1 in the head's copy, 1 in the target's" in f[0]["detail"], rep.findings
    assert "shape" not in f[0]["detail"].split("differs from")[1].split(")")[0]
