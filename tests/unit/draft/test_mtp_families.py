"""Config-only checks of the MTP families beyond DeepSeek-V3 (issue 37 part 5): GLM-4.7-Flash (GLM-4 MoE Lite, its
NextN layer after the last decoder layer, loaded by Glm4MoeLiteForCausalLM.load_weights) and Qwen3.5 (the layer count
in text_config.mtp_num_hidden_layers, the head under mtp.*), on config shapes mirroring the public configs
(tests/data/mtp_configs/README.md says which fields and from where)."""
from __future__ import annotations

import json

from helpers.draft.config_checks import check_configs
from helpers.draft.mtp_checks import MTPSpec, check_mtp
from helpers.engines.vllm_rules import VLLMMTPRules
from support import DATA

MTP = DATA / "mtp_configs"
GLM = MTP / "glm-4.7-flash_shape.json"
QWEN = MTP / "qwen3.5-27b_shape.json"


def _folder(tmp, src, name, edit=None, index=None):
    d = tmp / name
    d.mkdir()
    cfg = json.loads(src.read_text())
    if edit:
        edit(cfg)
    (d / "config.json").write_text(json.dumps(cfg))
    if index is not None:
        (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {k: "m.safetensors" for k in index}}))
    return d


def _kinds(rep):
    return [f["kind"] for f in rep.findings]


def test_glm_4_7_flash_loads_layer_47_and_refuses_two_layers_or_none(tmp_path):
    rep = check_configs(GLM, GLM, spec=MTPSpec("NEXTN", 1, 1, 2))
    loads = rep.draft_checks["facts"]["loads"]
    assert rep.findings == [] and loads["class"] == "Glm4MoeLiteForCausalLMNextN"
    assert loads["prefixes"] == ["model.layers.47."] and "_handle_eagle_family" in loads["draft_path"]
    assert "glm4_moe_lite.py::Glm4MoeLiteForCausalLM.load_weights" in loads["loader"]
    two = _folder(tmp_path, GLM, "two", lambda c: c.update(num_nextn_predict_layers=2))
    f = check_configs(two, two, spec=MTPSpec("NEXTN", 1, 1, 2)).findings
    assert _kinds_of(f) == ["mtp_head_refused"] and "Only 1 nextn layer is supported" in f[0]["detail"]
    # Glm4MoeLiteConfig (transformers 5.19) has no such field: left out, SGLang's loader raises ValueError
    none = _folder(tmp_path, GLM, "none", lambda c: c.pop("num_nextn_predict_layers"))
    f = check_configs(none, none, spec=MTPSpec("NEXTN", 1, 1, 2)).findings
    assert _kinds_of(f) == ["mtp_head_refused"] and "num_nextn_predict_layers is not in the config" in f[0]["detail"]
    # vLLM: Glm4MoeLiteMTPModel, n_predict 1; 3 tokens run the one layer 3 times
    v = check_mtp(GLM, GLM, spec=MTPSpec(num_steps=3), rules=VLLMMTPRules())
    assert v.draft_checks["facts"]["loads"]["class"] == "Glm4MoeLiteMTPModel"
    f = [x for x in v.findings if x["kind"] == "mtp_steps_beyond_head"]
    assert len(f) == 1 and "glm4_moe_lite_mtp.py" in f[0]["evidence"]["source"]


def _kinds_of(fs):
    return [f["kind"] for f in fs]


def test_glm_4_7_flash_weights_by_name_before_launch(tmp_path):
    p = "model.layers.47."
    full = [p + t for t in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                            "input_layernorm.weight", "post_attention_layernorm.weight")]
    ok = _folder(tmp_path, GLM, "ok", index=full)
    assert check_configs(ok, ok, spec=MTPSpec("NEXTN", 1, 1, 2)).findings == []
    cut = _folder(tmp_path, GLM, "cut", index=[k for k in full if "hnorm" not in k])
    f = check_configs(cut, cut, spec=MTPSpec("NEXTN", 1, 1, 2)).findings
    assert _kinds_of(f) == ["mtp_weights_missing"] and f[0]["evidence"]["missing"] == {p: [p + "hnorm.weight"]}
    assert "hnorm -> ones (RMSNorm init)" in f[0]["detail"]


def test_qwen3_5_reads_text_config_mtp_num_hidden_layers_and_the_mtp_prefix(tmp_path):
    rep = check_configs(QWEN, QWEN, spec=MTPSpec("NEXTN", 1, 1, 2))
    facts = rep.draft_checks["facts"]
    assert rep.findings == [] and facts["head"]["layers_field"] == "mtp_num_hidden_layers"
    assert facts["head"]["layers"] == 1 and facts["head"]["num_hidden_layers"] == 64
    assert facts["loads"]["class"] == "Qwen3_5ForCausalLMMTP" and facts["loads"]["prefixes"] == ["mtp."]
    assert "stays null" in facts["loads"]["draft_path"]         # not one of _handle_eagle_family's archs
    # two MTP layers declared: SGLang builds one and serves mtp.layers.0.* at every step (a note); vLLM reads both
    two = _folder(tmp_path, QWEN, "two", lambda c: c["text_config"].update(mtp_num_hidden_layers=2))
    rep = check_configs(two, two, spec=MTPSpec("NEXTN", 2, 1, 3))
    assert rep.findings == [] and any("only mtp.layers.0.* is served" in n for n in rep.advisories)
    v = check_mtp(two, two, spec=MTPSpec(num_steps=3), rules=VLLMMTPRules())
    f = [x for x in v.findings if x["kind"] == "mtp_head_refused"]
    assert len(f) == 1 and "must be divisible by n_predict=2" in f[0]["detail"]
    # the field left out: SGLang still builds its one layer; vLLM's n_predict is None and needs num_speculative_tokens
    none = _folder(tmp_path, QWEN, "none", lambda c: c["text_config"].pop("mtp_num_hidden_layers"))
    assert check_configs(none, none, spec=MTPSpec("NEXTN", 1, 1, 2)).findings == []
    v = check_mtp(none, none, rules=VLLMMTPRules())
    assert _kinds(v) == ["mtp_head_refused"] and "num_speculative_tokens` was not provided" in v.findings[0]["detail"]
    # the weights by name: the head's fc missing from the index
    idx = ["mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight",
           "mtp.layers.0.input_layernorm.weight"]
    cut = _folder(tmp_path, QWEN, "cut", index=idx[1:])
    f = check_configs(cut, cut, spec=MTPSpec("NEXTN", 1, 1, 2)).findings
    assert _kinds_of(f) == ["mtp_weights_missing"] and f[0]["evidence"]["missing"] == {"mtp.": ["mtp.fc.weight"]}
