"""Config-only checks of the MTP families beyond DeepSeek-V3 (issue 37 part 5): GLM-4.7-Flash (GLM-4 MoE Lite, its
NextN layer after the last decoder layer, loaded by Glm4MoeLiteForCausalLM.load_weights) and Qwen3.5 (the layer count
in text_config.mtp_num_hidden_layers, the head under mtp.*), on config shapes mirroring the public configs
(tests/data/mtp_configs/README.md says which fields and from where)."""
from __future__ import annotations

import json

import pytest

from helpers.draft.config_checks import check_configs
from helpers.draft.mtp_checks import MTPSpec, check_mtp
from helpers.engines.vllm_rules import VLLMMTPRules
from helpers.errors import BadInput
from support import DATA

MTP = DATA / "mtp_configs"
GLM = MTP / "glm-4.7-flash_shape.json"
QWEN = MTP / "qwen3.5-27b_shape.json"
MIMO = MTP / "mimo-7b_shape.json"


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
    f = [x for x in rep.findings if x["kind"] == "mtp_steps_beyond_head"]
    assert len(f) == 1 and f[0]["evidence"]["head_layers"] == 1 and f[0]["evidence"]["layers_declared"] == 2
    assert any("SGLang builds 1 head layer" in n and "past the first are not read" in n for n in rep.advisories)
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


def _steps_finding(rep):
    f = [x for x in rep.findings if x["kind"] == "mtp_steps_beyond_head"]
    return f[0] if f else None


def test_sglang_steps_compare_with_the_one_layer_it_builds_not_the_declared_count(tmp_path):
    """SGLang builds one head layer for Qwen3.5 and MiMo whatever the config declares (3, 0): 3 steps are 2 beyond
    it. vLLM builds the declared count (qwen3_5_mtp.py / mimo_mtp.py: one layer per mtp_num_hidden_layers /
    num_nextn_predict_layers), so 3 steps on 3 layers are no finding there."""
    spec = MTPSpec("NEXTN", 3, 1, 4)
    q3 = _folder(tmp_path, QWEN, "q3", lambda c: c["text_config"].update(mtp_num_hidden_layers=3))
    m3 = _folder(tmp_path, MIMO, "m3", lambda c: c.update(num_nextn_predict_layers=3))
    for d, field in ((q3, "mtp_num_hidden_layers"), (m3, "num_nextn_predict_layers")):
        rep = check_configs(d, d, spec=spec)
        f = _steps_finding(rep)
        assert f is not None and (f["evidence"]["head_layers"], f["evidence"]["layers_declared"]) == (1, 3)
        assert f"the 1 head layer SGLang builds ({field} 3)" in f["detail"]
        assert "--speculative-num-steps 1 " in f["evidence"]["fix"]
        assert rep.draft_checks["facts"]["loads"]["layers_loaded"] == 1
        assert _steps_finding(check_mtp(d, d, spec=MTPSpec(num_steps=3), rules=VLLMMTPRules())) is None
    # MiMo: every model.mtp_layers.<i>. goes into the one block (mimo_mtp.py::map_model_name_to_mtp_param_name)
    rep = check_configs(m3, m3, spec=spec)
    assert any("each overwriting the layer read before it" in n for n in rep.advisories)
    # one step with 3 declared: no step beyond the built layer, the note still says what is not served
    rep = check_configs(q3, q3, spec=MTPSpec("NEXTN", 1, 1, 2))
    assert rep.findings == [] and any("past the first are not read" in n for n in rep.advisories)


def test_sglang_zero_declared_layers_names_the_built_layer_not_a_checkpoint_layer(tmp_path):
    spec = MTPSpec("NEXTN", 3, 1, 4)
    q0 = _folder(tmp_path, QWEN, "q0", lambda c: c["text_config"].update(mtp_num_hidden_layers=0))
    m0 = _folder(tmp_path, MIMO, "m0", lambda c: c.update(num_nextn_predict_layers=0))
    for d, field in ((q0, "mtp_num_hidden_layers"), (m0, "num_nextn_predict_layers")):
        rep = check_configs(d, d, spec=spec)
        f = _steps_finding(rep)
        assert f is not None and "in the checkpoint" not in f["detail"]
        assert f"SGLang builds ({field} 0)" in f["detail"] and f["evidence"]["layers_declared"] == 0
        assert any(f"{field} is 0" in n and "builds one" in n for n in rep.advisories)
        # vLLM: n_predict 0, no layer to run: refused
        v = check_mtp(d, d, spec=MTPSpec(num_steps=3), rules=VLLMMTPRules())
        assert _kinds(v) == ["mtp_head_refused"] and f"{field} is 0" in v.findings[0]["detail"]


@pytest.mark.parametrize("src,edit,needle", [
    (MTP / "deepseek-v3-nextn-checkpoint_shape.json", lambda c: c.update(architectures="DeepseekV3ForCausalLM"),
     "[architectures]: expected a list of architecture names (strings), got 'DeepseekV3ForCausalLM'"),
    (QWEN, lambda c: c.update(text_config="garbage"),
     "[text_config]: expected an object (the text sub-config), got 'garbage'"),
    (QWEN, lambda c: c.update(text_config=[1]), "[text_config]: expected an object"),
])
def test_malformed_mtp_config_fields_are_named(tmp_path, src, edit, needle):
    d = _folder(tmp_path, src, "bad", edit)
    with pytest.raises(BadInput) as e:
        check_configs(d, d, spec=MTPSpec("NEXTN", 3, 1, 4))
    msg = str(e.value)
    assert "\n" not in msg and str(d / "config.json") in msg and needle in msg
