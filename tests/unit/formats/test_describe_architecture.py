"""describe_architecture: one line naming a model's architecture from its config.json, read as SGLang reads it (a
wrapper's text sub-config): the Kimi-class target is MLA + MoE, the Llama reference dense, the MLA draft's one layer
dense (below first_k_dense_replace), Mixtral-style configs MoE without shared experts."""
from __future__ import annotations

import json

import pytest

from helpers.errors import BadInput
from helpers.formats.configs import describe_architecture
from support import ROOT

MODELS = ROOT / "env" / "models"


@pytest.mark.skipif(not (MODELS / "kimi" / "target" / "config.json").exists(), reason="env/models not built")
def test_the_shipped_models():
    assert describe_architecture(MODELS / "kimi" / "target") == (
        "DeepseekV3ForCausalLM: MLA attention (8 heads, q_lora_rank 64, kv_lora_rank 64), MoE (8 routed experts, "
        "top-2, 1 shared; first 1 layer dense), 8 layers, hidden 128")
    assert describe_architecture(MODELS / "kimi" / "draft" / "config.json") == (
        "LlamaForCausalLMEagle3: attention (8 heads, 8 KV heads), dense MLP, 1 layer, hidden 128")
    assert describe_architecture(MODELS / "kimi" / "draft_mla") == (
        "Eagle3DeepseekV2ForCausalLM: MLA attention (8 heads, q_lora_rank 64, kv_lora_rank 64), dense MLP (every layer "
        "below first_k_dense_replace 1; the MoE fields are unused), 1 layer, hidden 128")
    assert describe_architecture(MODELS / "target") == (
        "LlamaForCausalLM: attention (8 heads, 8 KV heads), dense MLP, 8 layers, hidden 128")


def test_a_wrapper_is_read_through_its_text_config_and_other_moe_fields(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
        "text_config": {"model_type": "kimi_k2", "hidden_size": 7168, "num_hidden_layers": 61,
                        "num_attention_heads": 64, "q_lora_rank": 1536, "kv_lora_rank": 512, "n_routed_experts": 384,
                        "num_experts_per_tok": 8, "n_shared_experts": 1, "first_k_dense_replace": 1}}))
    assert describe_architecture(tmp_path) == (
        "KimiK25ForConditionalGeneration: MLA attention (64 heads, q_lora_rank 1536, kv_lora_rank 512), MoE (384 "
        "routed experts, top-8, 1 shared; first 1 layer dense), 61 layers, hidden 7168")
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["MixtralForCausalLM"], "hidden_size": 4096, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2}))
    assert describe_architecture(tmp_path / "config.json") == (
        "MixtralForCausalLM: attention (32 heads, 8 KV heads), MoE (8 routed experts, top-2), 32 layers, hidden 4096")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 768, "n_layer": 12}))
    assert describe_architecture(tmp_path) == "gpt2: attention, dense MLP, 12 layers, hidden 768"


def test_a_missing_or_broken_config_is_bad_input(tmp_path):
    with pytest.raises(BadInput, match="config.json"):
        describe_architecture(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(BadInput, match="JSON object"):
        describe_architecture(tmp_path)
