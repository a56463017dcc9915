"""Config-only checks of the MTP families added in issue 37 part 5 (second batch): Step-3.5 (SGLang builds one head per
draft step and serves each layer's own lm_head copy; both engines refuse a head with a tensor missing) and ERNIE-4.5
MoE (flat ``model.mtp_*.0`` names, SGLang refuses only a head with none of its tensors).

The configs (tests/data/mtp_configs/README.md) hold the values of the engines' own config classes: Step-3.5-Flash from
SGLang 0.5.23's ``sglang/srt/configs/step3p5.py::Step3p5Config.__init__`` (45 layers; 3 MTP layers per its l. 99-101
comment), ERNIE-4.5 MoE from transformers 5.19's ``Ernie4_5_MoeConfig`` (28 layers, tied embeddings). The own-copies
test writes real safetensors and compares real tensors."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from helpers.draft.mtp_checks import MTPRules, MTPSpec, check_mtp
from helpers.draft.mtp_weights import head_weight_findings
from helpers.draft.nextn_stage import steps_check
from helpers.engines.vllm_rules import VLLMMTPRules
from helpers.investigation.mtp import head_depth
from support import DATA
from support.mtp_folders import config_folder as _folder

MTP = DATA / "mtp_configs"
STEP = json.loads((MTP / "step-3.5-flash_defaults.json").read_text())
ERNIE = json.loads((MTP / "ernie-4.5-moe_defaults.json").read_text())
#: a Step-3.5 NextN layer's tensors under its prefix (step3p5_mtp.py::Step3p5AMultiTokenPredictor.__init__)
STEP_LAYER = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight", "shared_head.output.weight",
              "input_layernorm.weight", "post_attention_layernorm.weight")
#: ERNIE-4.5's flat MTP tensors (ernie4_eagle.py::Ernie4_5_MoeForCausalLMMTP.load_weights patterns)
ERNIE_HEAD = ["model.mtp_emb_norm.0.weight", "model.mtp_hidden_norm.0.weight", "model.mtp_linear_proj.0.weight",
              "model.mtp_block.0.input_layernorm.weight", "model.mtp_block.0.post_attention_layernorm.weight",
              "model.mtp_block.0.self_attn.q_proj.weight"]


def _one(rep, kind: str) -> dict:
    fs = [f for f in rep.findings if f["kind"] == kind]
    assert len(fs) == 1, rep.findings
    return fs[0]


def _step_names(layers=range(45, 48)) -> list[str]:
    return ["model.embed_tokens.weight", "lm_head.weight"] + [f"model.layers.{i}.{t}" for i in layers for t in STEP_LAYER]


def test_step3p5_sglang_builds_one_head_per_step_each_reading_its_own_layer(tmp_path):
    d = _folder(tmp_path, "s", STEP, index=_step_names())
    rep = check_mtp(d, d, spec=MTPSpec("EAGLE", 3, 1, 4))
    loads = rep.draft_checks["facts"]["loads"]
    assert rep.findings == [] and loads["class"] == "Step3p5MTP"
    assert loads["prefixes"] == ["model.layers.45.", "model.layers.46.", "model.layers.47."]
    assert (loads["layers_declared"], loads["layers_loaded"]) == (3, 3)
    assert "set_embed_and_head l. 186-187 is a no-op" in loads["embedding_and_lm_head"]
    assert "shared_head.output.weight" in loads["embedding_and_lm_head"]
    # no steps given: SGLang's auto (3, 1, 4), one trained layer per step
    auto = check_mtp(d, d, spec=MTPSpec("EAGLE"))
    assert auto.findings == [] and auto.draft_checks["facts"]["loads"]["layers_loaded"] == 3
    # the live path: SGLang's depth for this head is its 3 layers, so 3 served steps are within it
    att = SimpleNamespace(draft_dir=d, draft_head={"layers": 3})
    assert head_depth(att, MTPRules()) == 3 and steps_check(3, 3, None) is None


def test_step3p5_sglang_refuses_steps_past_its_layers_and_the_absent_field(tmp_path):
    d = _folder(tmp_path, "s", STEP)
    f = _one(check_mtp(d, d, spec=MTPSpec("EAGLE", 4, 1, 5)), "mtp_head_refused")
    assert (f["evidence"]["num_steps"], f["evidence"]["head_layers"]) == (4, 3)
    assert f["evidence"]["error"].startswith("RuntimeError(") and "model.layers.48.*" in f["detail"]
    assert "--speculative-num-steps 3" in f["evidence"]["fix"]
    absent = _folder(tmp_path, "absent", STEP, num_nextn_predict_layers=None)
    rep = check_mtp(absent, absent, spec=MTPSpec("EAGLE", 1, 1, 2))
    f = _one(rep, "mtp_head_refused")
    assert (f["evidence"]["head_layers"], f["evidence"]["layers_declared"]) == (0, None)
    assert "without speculative decoding" in f["evidence"]["fix"]
    # topk 2 with 4 draft tokens over 3 steps: the multi-layer EAGLE worker asserts draft tokens == steps + 1
    f = _one(check_mtp(d, d, spec=MTPSpec("EAGLE", 3, 2, 5)), "mtp_head_refused")
    assert f["evidence"]["num_draft_tokens"] == 5 and f["evidence"]["error"].startswith("AssertionError(")


def test_step3p5_sglang_with_nextn_builds_one_head_without_a_draft_index_and_fails_to_load(tmp_path):
    """--speculative-algorithm NEXTN: _step3p_overrides tests speculative_algorithm == "EAGLE" before NEXTN is aliased,
    so no multi-layer EAGLE: one Step3p5MTP with draft_model_idx None, whose load_weights adds None to
    num_hidden_layers on the first head tensor (TypeError at start-up)."""
    d = _folder(tmp_path, "s", STEP, index=_step_names())
    for algo in ("NEXTN", "eagle"):                      # lower case is upper-cased only after the override ran
        rep = check_mtp(d, d, spec=MTPSpec(algo, 3, 1, 4))
        f = _one(rep, "mtp_head_refused")
        assert [x["kind"] for x in rep.findings] == ["mtp_head_refused"] and rep.verdict == "mismatch"
        assert f["evidence"]["error"].startswith("TypeError(") and f["evidence"]["algorithm"] == algo
        assert "step3p5_mtp.py::Step3p5MTP.load_weights l. 211-213" in f["evidence"]["source"]
        assert "--speculative-algorithm EAGLE" in f["evidence"]["fix"]
        assert rep.draft_checks["facts"]["loads"]["multi_layer_eagle"] is False
    # no tensor names: the declared layers are taken as present (refused); a checkpoint without the head layers starts
    cfg_only = _folder(tmp_path, "c", STEP)
    assert [x["kind"] for x in check_mtp(cfg_only, cfg_only, spec=MTPSpec("NEXTN", 1, 1, 2)).findings] == [
        "mtp_head_refused"]
    bare = _folder(tmp_path, "b", STEP, index=["model.embed_tokens.weight", "model.layers.0.input_layernorm.weight"])
    assert "mtp_head_refused" not in [x["kind"] for x in check_mtp(bare, bare, spec=MTPSpec("NEXTN", 1, 1, 2)).findings]


def test_step3p5_any_missing_tensor_refuses_both_engines(tmp_path):
    names = [n for n in _step_names() if n != "model.layers.46.hnorm.weight"]
    d = _folder(tmp_path, "s", STEP, index=names)
    f = _one(check_mtp(d, d, spec=MTPSpec("EAGLE", 3, 1, 4)), "mtp_weights_missing")
    assert f["evidence"]["missing"] == {"model.layers.46.": ["model.layers.46.hnorm.weight"]}
    assert "SGLang refuses to start: RuntimeError(" in f["detail"] and f["evidence"]["refused"].startswith("Runtime")
    assert "step3p5_mtp.py::Step3p5MTP.load_weights l. 287-295" in f["evidence"]["source"]
    # 2 steps: SGLang reads layers 45 and 46 only, so the gap at 46 still refuses; at 1 step it is never read
    assert _one(check_mtp(d, d, spec=MTPSpec("EAGLE", 2, 1, 3)), "mtp_weights_missing")
    assert check_mtp(d, d, spec=MTPSpec("EAGLE", 1, 1, 2)).findings == []
    v = _one(check_mtp(d, d, spec=MTPSpec(num_steps=3), rules=VLLMMTPRules()), "mtp_weights_missing")
    assert "vLLM refuses to start: RuntimeError(" in v["detail"] and "mtp_validation.py" in v["evidence"]["source"]


def test_step3p5_vllm_builds_n_predict_layers_and_defaults_it_to_1(tmp_path):
    d = _folder(tmp_path, "s", STEP, index=_step_names())
    rep = check_mtp(d, d, spec=MTPSpec(), rules=VLLMMTPRules())
    loads = rep.draft_checks["facts"]["loads"]
    assert rep.findings == [] and loads["n_predict"] == 3 and loads["layers_loaded"] == 3
    assert loads["prefixes"] == ["model.layers.45.", "model.layers.46.", "model.layers.47."]
    assert "has_own_lm_head" in loads["embedding_and_lm_head"]
    # the field absent: hf_config_override's getattr(..., 1) gives n_predict 1, so 2 tokens rerun layer 45
    absent = _folder(tmp_path, "absent", STEP, num_nextn_predict_layers=None)
    rep = check_mtp(absent, absent, spec=MTPSpec(num_steps=2), rules=VLLMMTPRules())
    assert rep.draft_checks["facts"]["loads"]["n_predict"] == 1
    assert rep.draft_checks["facts"]["loads"]["prefixes"] == ["model.layers.45."]
    f = _one(rep, "mtp_steps_beyond_head")["evidence"]
    assert (f["num_steps"], f["head_layers"]) == (2, 1) and "spec_step_idx % num_mtp_layers" in f["source"]
    assert "exempts step3p5_mtp" in _one(rep, "mtp_steps_beyond_head")["detail"]


def _tiny_step3p5(tmp: Path) -> tuple[Path, dict]:
    """A 2-layer Step-3.5 folder with one NextN layer (model.layers.2.*) whose lm_head and embedding copies differ
    from the target's; real tensors."""
    d = tmp / "tiny"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["Step3p5ForCausalLM"], "model_type": "step3p5",
                                               "num_hidden_layers": 2, "hidden_size": 8, "vocab_size": 16,
                                               "num_nextn_predict_layers": 1}))
    g = torch.Generator().manual_seed(0)
    t = {n: torch.randn(16, 8, generator=g) for n in ("model.embed_tokens.weight", "lm_head.weight")}
    p = "model.layers.2."
    t.update({p + n: torch.ones(8) for n in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight",
                                             "input_layernorm.weight", "post_attention_layernorm.weight")})
    t[p + "eh_proj.weight"] = torch.randn(8, 16, generator=g)
    t[p + "shared_head.output.weight"] = t["lm_head.weight"] + 0.5 * torch.randn(16, 8, generator=g)
    t[p + "embed_tokens.weight"] = t["model.embed_tokens.weight"] * 2
    save_file({k: v.contiguous() for k, v in t.items()}, str(d / "model.safetensors"))
    return d, t


def test_step3p5_own_copies_are_served_not_replaced(tmp_path):
    d, t = _tiny_step3p5(tmp_path)
    want_head = float((t["model.layers.2.shared_head.output.weight"] - t["lm_head.weight"]).norm()
                      / t["lm_head.weight"].norm())
    facts: dict = {}
    assert head_weight_findings(d, d, MTPRules(), facts) == []         # SGLang serves both copies: no finding
    seen = {c["tensor"]: c for c in facts["own_copies"]}
    head = seen["model.layers.2.shared_head.output.weight"]
    assert head["equal"] is False and head["rel_diff"] == pytest.approx(want_head, rel=1e-5)
    assert head["target"] == "lm_head.weight" and "no-op" in head["served"]
    emb = seen["model.layers.2.embed_tokens.weight"]
    assert emb["rel_diff"] == pytest.approx(1.0, rel=1e-6) and "served" in emb
    # vLLM keeps the own lm_head copy but shares the target's embedding: only the embedding is a replacement
    facts = {}
    fs = head_weight_findings(d, d, VLLMMTPRules(), facts)
    assert [f["kind"] for f in fs] == ["embedding_replaced"]
    assert fs[0]["evidence"]["rel_diff"] == pytest.approx(1.0, rel=1e-6)
    assert "served" in {c["tensor"]: c for c in facts["own_copies"]}["model.layers.2.shared_head.output.weight"]


def test_step3p5_weights_check_reads_every_declared_layer_on_sglang(tmp_path):
    d, _ = _tiny_step3p5(tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "num_nextn_predict_layers": 2}))
    facts: dict = {}
    fs = head_weight_findings(d, d, MTPRules(), facts)
    assert [f["kind"] for f in fs] == ["mtp_weights_missing"] and list(fs[0]["evidence"]["missing"]) == ["model.layers.3."]
    assert fs[0]["evidence"]["refused"].startswith("RuntimeError(")


def test_ernie_reads_the_flat_mtp_0_names_and_reruns_its_one_layer(tmp_path):
    d = _folder(tmp_path, "e", ERNIE, index=ERNIE_HEAD + ["model.embed_tokens.weight"])
    rep = check_mtp(d, d, spec=MTPSpec("NEXTN", 1, 1, 2))
    loads = rep.draft_checks["facts"]["loads"]
    assert rep.findings == [] and loads["class"] == "Ernie4_5_MoeForCausalLMMTP"
    assert loads["prefixes"] == ["model."] and loads["layers_loaded"] == 1
    assert "set_embed_and_head" in loads["embedding_and_lm_head"]       # the target's, not own copies
    f = _one(check_mtp(d, d, spec=MTPSpec("NEXTN", 3, 1, 4)), "mtp_steps_beyond_head")["evidence"]
    assert (f["num_steps"], f["head_layers"]) == (3, 1)
    v = check_mtp(d, d, spec=MTPSpec(), rules=VLLMMTPRules())
    assert v.findings == [] and v.draft_checks["facts"]["loads"]["n_predict"] == 1
    assert v.draft_checks["facts"]["settings"]["num_steps"] == 1
    # field absent (Ernie4_5_MoeConfig has none): vLLM's n_predict is None and no token count defaults
    absent = _folder(tmp_path, "absent", ERNIE, num_nextn_predict_layers=None)
    assert "num_speculative_tokens` was not provided" in _one(
        check_mtp(absent, absent, spec=MTPSpec(), rules=VLLMMTPRules()), "mtp_head_refused")["detail"]


def test_ernie_sglang_starts_on_a_partial_head_and_refuses_an_absent_one(tmp_path):
    part = _folder(tmp_path, "part", ERNIE, index=[n for n in ERNIE_HEAD if "hidden_norm" not in n
                                                   and "linear_proj" not in n])
    f = _one(check_mtp(part, part, spec=MTPSpec("NEXTN", 1, 1, 2)), "mtp_weights_missing")
    assert f["evidence"]["missing"] == {"model.": ["model.mtp_hidden_norm.0.weight", "model.mtp_linear_proj.0.weight"]}
    assert "refused" not in f["evidence"] and "SGLang starts anyway" in f["detail"]
    assert "mtp_hidden_norm.0 -> ones (RMSNorm init)" in f["detail"]
    assert "mtp_linear_proj.0 -> torch's nn.Linear random init" in f["detail"]
    none = _folder(tmp_path, "none", ERNIE, index=["model.embed_tokens.weight", "model.layers.0.mlp.gate.weight"])
    f = _one(check_mtp(none, none, spec=MTPSpec("NEXTN", 1, 1, 2)), "mtp_weights_missing")
    assert f["evidence"]["refused"].startswith("KeyError(") and "SGLang refuses to start" in f["detail"]
    assert "ernie4_eagle.py::Ernie4_5_MoeForCausalLMMTP.load_weights l. 183-186" in f["evidence"]["source"]
    # vLLM refuses both (its default loader's check), with its own message
    v = _one(check_mtp(part, part, spec=MTPSpec(), rules=VLLMMTPRules()), "mtp_weights_missing")
    assert "Following weights were not initialized" in v["detail"]


QWEN3_MOE = json.loads((MTP / "qwen3-moe-mtp_defaults.json").read_text())


def test_qwen3_moe_mtp_is_sglang_only_with_one_layer_under_mtp(tmp_path):
    names = ["mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight",
             "mtp.layers.0.input_layernorm.weight", "mtp.norm.weight"]
    d = _folder(tmp_path, "q", QWEN3_MOE, index=names, num_nextn_predict_layers=2)
    rep = check_mtp(d, d, spec=MTPSpec("NEXTN", 2, 1, 3))
    loads = rep.draft_checks["facts"]["loads"]
    assert loads["class"] == "Qwen3MoeForCausalLMMTP" and loads["rewrite"].endswith("num_nextn_predict_layers = 1")
    assert loads["prefixes"] == ["mtp."] and (loads["layers_declared"], loads["layers_loaded"]) == (2, 1)
    assert [f["kind"] for f in rep.findings] == ["mtp_steps_beyond_head"]
    assert any("outside the one layer built" in n for n in rep.draft_checks["notes"])
    cut = _folder(tmp_path, "cut", QWEN3_MOE, index=[n for n in names if "fc.weight" != n.split("mtp.")[1]])
    f = _one(check_mtp(cut, cut, spec=MTPSpec("NEXTN", 1, 1, 2)), "mtp_weights_missing")
    assert f["evidence"]["missing"] == {"mtp.": ["mtp.fc.weight"]} and "torch's nn.Linear random init" in f["detail"]
    # vLLM 0.32.0: no Qwen3-MoE MTP head, method mtp is refused at start-up
    v = check_mtp(d, d, spec=MTPSpec(num_steps=1), rules=VLLMMTPRules())
    f = _one(v, "mtp_head_refused")
    assert f["evidence"]["error"].startswith("NotImplementedError(") and "l. 1325-1391" in f["evidence"]["source"]
    from helpers.engines.vllm_mtp import cpu_refusal
    assert "is not a target vLLM 0.32.0 maps to an MTP head" in cpu_refusal(QWEN3_MOE)


BAILING = json.loads((MTP / "bailing-moe-v2_defaults.json").read_text())


def test_bailing_sglang_one_nextn_class_for_four_targets_with_deepseeks_rule(tmp_path):
    p = "model.layers.24."
    names = [p + t for t in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "final_layernorm.weight",
                             "input_layernorm.weight", "post_attention_layernorm.weight", "shared_head.head.weight")]
    for arch in ("BailingMoeForCausalLM", "BailingMoeV2ForCausalLM", "BailingMoeV2_5ForCausalLM",
                 "BailingMoeV3ForCausalLM"):
        d = _folder(tmp_path, arch, BAILING, index=names, architectures=[arch])
        rep = check_mtp(d, d, spec=MTPSpec("NEXTN", 1, 1, 2))
        loads = rep.draft_checks["facts"]["loads"]
        assert rep.findings == [] and loads["class"] == "BailingMoeForCausalLMNextN", arch
        assert loads["prefixes"] == [p] and "set_embed_and_head" in loads["embedding_and_lm_head"]
    two = _folder(tmp_path, "two", BAILING, num_nextn_predict_layers=2)
    f = _one(check_mtp(two, two, spec=MTPSpec("NEXTN", 1, 1, 2)), "mtp_head_refused")
    assert f["evidence"]["error"] == 'AssertionError("Only 1 nextn layer is supported")'
    absent = _folder(tmp_path, "absent", BAILING, num_nextn_predict_layers=None)
    assert _one(check_mtp(absent, absent, spec=MTPSpec("NEXTN", 1, 1, 2)),
                "mtp_head_refused")["evidence"]["error"].startswith("ValueError(")
    cut = _folder(tmp_path, "cut", BAILING, index=[n for n in names if "final_layernorm" not in n])
    f = _one(check_mtp(cut, cut, spec=MTPSpec("NEXTN", 1, 1, 2)), "mtp_weights_missing")
    assert f["evidence"]["missing"] == {p: [p + "final_layernorm.weight"]} and "ones (RMSNorm init)" in f["detail"]


@pytest.mark.parametrize("arch,cls,file", [
    ("BailingMoeV2_5ForCausalLM", "BailingMoeV25MTPModel", "bailing_moe_mtp.py"),
    ("BailingMoeV3ForCausalLM", "BailingMoeV3MTPModel", "bailing_moe_v3_mtp.py"),
    ("BailingMoeV2ForCausalLM", None, None),
    ("BailingMoeForCausalLM", None, None),
])
def test_bailing_vllm_heads_by_target_class(tmp_path, arch, cls, file):
    d = _folder(tmp_path, "b", BAILING, architectures=[arch], num_nextn_predict_layers=2)
    rep = check_mtp(d, d, spec=MTPSpec(num_steps=4), rules=VLLMMTPRules())
    if cls is None:
        f = _one(rep, "mtp_head_refused")
        assert f["evidence"]["target_arch"] == arch and f["evidence"]["error"].startswith("NotImplementedError(")
        return
    loads = rep.draft_checks["facts"]["loads"]
    assert loads["class"] == cls and loads["file"].endswith(file) and loads["n_predict"] == 2
    assert loads["prefixes"] == ["model.layers.24.", "model.layers.25."]
    f = _one(rep, "mtp_steps_beyond_head")["evidence"]
    assert (f["num_steps"], f["head_layers"]) == (4, 2) and file in f["source"]
