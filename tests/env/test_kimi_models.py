"""The Kimi-class reference models (env/models/kimi), the head_dim-64 Llama (env/models/llama_h64) and the
validation rows shipped next to every draft's training log.

* the Kimi target is a ``DeepseekV3ForCausalLM`` with MLA, routed + shared experts, ``noaux_tc`` sigmoid routing
  with a trained non-zero correction bias and factor-1 yarn RoPE; its config parses in transformers and in
  SGLang 0.5.23's own ``ModelConfig``; it is a trained LM whose routing uses every expert;
* both Kimi drafts follow SGLang's layouts: the Llama-style one ``llama_eagle3.py``'s, the MLA one
  ``kimi_k25_eagle3.py``'s, checked by loading it with SGLang's own ``Eagle3DeepseekV2ForCausalLM.load_weights``
  (fused q_a / kv_a, stacked gate / up, w_kc / w_vc split, hot token ids, RoPE cache, softmax scale) and by the
  trainer's expanded MLA agreeing with SGLang's weight-absorbed form;
* samples and validation rows are SpecForge format, the validation rows are the first N of the training log's
  validation split, and the drafts are accurate on them and lose accuracy with the aux chunks reversed.
"""
from __future__ import annotations

import json
import math
import os
import re
import subprocess
from pathlib import Path

import pytest
import torch

from support import ROOT, import_from

MODELS = ROOT / "env" / "models"
import_from(MODELS, "e3f_models")
from e3f_models import (DRAFT_DIR, KIMI_DIR, LLAMA_H64_DIR, PROMPTS_FILE, TARGET_DIR,  # noqa: E402
                        VALIDATION_DIR, specforge_default_layer_ids)
from e3f_models.draft import ttt_loss  # noqa: E402
from e3f_models.draft_arch import load_draft  # noqa: E402
from e3f_models.nextn import load_nextn, nextn_loss  # noqa: E402
from e3f_models.specforge_data import list_records, read_record, read_vocab_mapping  # noqa: E402

BF16_RTOL = 2.0 ** -7
KIMI_TARGET, KIMI_DRAFT, KIMI_MLA = KIMI_DIR / "target", KIMI_DIR / "draft", KIMI_DIR / "draft_mla"
H64_TARGET, H64_DRAFT = LLAMA_H64_DIR / "target", LLAMA_H64_DIR / "draft"
# (draft, its target, its data folder) for every draft that ships validation rows
DRAFTS = {"llama": (DRAFT_DIR, TARGET_DIR, MODELS / "data"),
          "kimi": (KIMI_DRAFT, KIMI_TARGET, KIMI_DIR / "data"),
          "kimi_mla": (KIMI_MLA, KIMI_TARGET, KIMI_DIR / "data"),
          "llama_h64": (H64_DRAFT, H64_TARGET, LLAMA_H64_DIR / "data")}
# the checkpoint names Eagle3DeepseekV2ForCausalLM.load_weights reads (sglang/srt/models/kimi_k25_eagle3.py)
MLA_DRAFT_KEYS = {
    "fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
    *(f"layers.0.self_attn.{n}.weight" for n in ("q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa",
                                                  "kv_a_layernorm", "kv_b_proj", "o_proj")),
    *(f"layers.0.mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
    *(f"layers.0.{n}.weight" for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm")),
}
LLAMA_DRAFT_KEYS = {
    "fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
    *(f"midlayer.self_attn.{p}_proj.weight" for p in "qkvo"),
    *(f"midlayer.mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
    *(f"midlayer.{n}.weight" for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm")),
}


def _cfg(d: Path) -> dict:
    return json.loads((d / "config.json").read_text())


def _weights(d: Path) -> dict:
    from safetensors.torch import load_file
    return load_file(str(d / "model.safetensors"))


@pytest.fixture(scope="module")
def kimi_target():
    from transformers import AutoModelForCausalLM
    m = AutoModelForCausalLM.from_pretrained(KIMI_TARGET, dtype=torch.float32)
    m.eval()
    return m


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(KIMI_TARGET)


def test_kimi_target_config_is_kimi_class_and_parses_in_transformers():
    from transformers import AutoConfig
    c = _cfg(KIMI_TARGET)
    n = c["num_hidden_layers"]
    assert c["architectures"] == ["DeepseekV3ForCausalLM"] and c["model_type"] == "deepseek_v3" and n == 8
    # MLA
    assert c["q_lora_rank"] and c["kv_lora_rank"] and c["qk_nope_head_dim"] and c["qk_rope_head_dim"]
    assert c["num_attention_heads"] % 8 == 0  # TP 8 shards the heads
    # MoE: routed experts (>= 8 for TP 8: deepseek_v2.py::DeepseekV2MoE.__init__), a shared expert, dense first
    assert c["n_routed_experts"] >= 8 and c["n_routed_experts"] % 8 == 0 and c["num_experts_per_tok"] >= 2
    assert c["n_shared_experts"] == 1 and c["first_k_dense_replace"] >= 1 and c["moe_layer_freq"] == 1
    # the keys SGLang reads that DeepseekV3Config does not define
    assert (c["topk_method"], c["scoring_func"]) == ("noaux_tc", "sigmoid")
    r = c["rope_parameters"]
    assert r["rope_type"] == "yarn" and r["factor"] == 1.0
    assert r["original_max_position_embeddings"] == c["max_position_embeddings"]
    assert c["rope_interleave"] is True and c["tie_word_embeddings"] is False
    ids = specforge_default_layer_ids(n)
    assert len(set(ids)) == 3 and max(ids) < n - 1
    hf = AutoConfig.from_pretrained(KIMI_TARGET)
    assert type(hf).__name__ == "DeepseekV3Config"
    assert (hf.topk_method, hf.scoring_func, hf.moe_layer_freq) == ("noaux_tc", "sigmoid", 1)
    # the same tokenizer as the Llama target
    assert (KIMI_TARGET / "tokenizer.json").read_bytes() == (TARGET_DIR / "tokenizer.json").read_bytes()


def test_kimi_target_checkpoint_has_per_expert_names_and_a_trained_fp32_correction_bias():
    w = _weights(KIMI_TARGET)
    c = _cfg(KIMI_TARGET)
    E, k0 = c["n_routed_experts"], c["first_k_dense_replace"]
    assert "lm_head.weight" in w  # untied
    for L in range(c["num_hidden_layers"]):
        moe = L >= k0
        assert (f"model.layers.{L}.mlp.gate.weight" in w) == moe
        assert (f"model.layers.{L}.mlp.gate_proj.weight" in w) == (not moe)
        if moe:
            for e in range(E):
                for p in ("gate", "up", "down"):
                    assert f"model.layers.{L}.mlp.experts.{e}.{p}_proj.weight" in w
            assert f"model.layers.{L}.mlp.shared_experts.down_proj.weight" in w
            b = w[f"model.layers.{L}.mlp.gate.e_score_correction_bias"]
            assert b.dtype == torch.float32 and b.shape == (E,)
            assert b.abs().max() > 1e-3 and b.std() > 1e-4  # the aux-loss-free balancing moved it
    assert all(v.dtype == torch.bfloat16 for k, v in w.items() if not k.endswith("e_score_correction_bias"))


def test_kimi_target_is_a_trained_lm_that_uses_every_expert(kimi_target, tokenizer):
    prompts = json.loads(PROMPTS_FILE.read_text())["prompts"][:16]
    counts = torch.zeros(_cfg(KIMI_TARGET)["n_routed_experts"])
    gate = kimi_target.model.layers[-1].mlp.gate
    def count(module, inputs, out):  # the router returns (logits, weights, topk indices)
        counts.add_(torch.bincount(out[2].reshape(-1), minlength=len(counts)))

    h = gate.register_forward_hook(count)
    try:
        with torch.no_grad():
            losses = [kimi_target(input_ids=t, labels=t).loss.item()
                      for t in (torch.tensor([tokenizer(p)["input_ids"]]) for p in prompts)]
    finally:
        h.remove()
    assert sum(losses) / len(losses) < 6.0, losses  # uniform: ln 4096 = 8.3
    share = counts / counts.sum()
    assert share.min() > 0.02, share  # no dead expert in the last MoE layer on held-out text
    log = json.loads((KIMI_TARGET / "training_log.json").read_text())
    assert log["saved_bf16"]["heldout_ppl"] < 100 and log["family"] == "kimi"


@pytest.fixture(scope="module")
def sglang_facts(tmp_path_factory):
    """One SGLang-venv process (tests/support/sglang_mla_draft_load.py): the three Kimi folders and the exported NextN
    checkpoint through SGLang's ModelConfig, the MLA draft loaded by SGLang's own Eagle3DeepseekV2ForCausalLM, and the
    NextN head loaded by SGLang's own DeepseekV3ForCausalLMNextN from the target folder and from the export."""
    py = Path(os.environ.get("E3F_SGLANG_PYTHON") or ROOT / "env" / "reference" / ".venv" / "bin" / "python")
    if not py.exists():
        pytest.skip("SGLang venv missing (env/reference/install.sh)")
    out = tmp_path_factory.mktemp("sglang") / "facts.pt"
    env = {**os.environ, "SGLANG_USE_CPU_ENGINE": "1", "TORCHDYNAMO_DISABLE": "1", "E3F_LOOPBACK_STORE": "1",
           "PYTHONPATH": str(ROOT / "env" / "reference" / "standin")}
    from helpers.formats.nextn import export_nextn
    exported = tmp_path_factory.mktemp("nextn") / "kimi-nextn"
    export_nextn(KIMI_TARGET, exported)
    res = subprocess.run([str(py), str(ROOT / "tests" / "support" / "sglang_mla_draft_load.py"), str(KIMI_MLA),
                          str(out), f"target={KIMI_TARGET}", f"draft={KIMI_DRAFT}:draft",
                          f"draft_mla={KIMI_MLA}:draft", f"nextn_export={exported}:draft",
                          f"nextn:target={KIMI_TARGET}", f"nextn:export={exported}"],
                         capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    return torch.load(out, weights_only=True)


def test_kimi_target_parses_in_sglang_model_config_with_both_drafts(sglang_facts):
    """SGLang 0.5.23's own config path (configs/model_config.py::ModelConfig) on the three folders."""
    out = sglang_facts["configs"]
    t, d, m = out["target"], out["draft"], out["draft_mla"]
    assert t["arch"] == ["DeepseekV3ForCausalLM"] and t["layers"] == 8 and t["mla"] == "MLA"
    assert (t["topk"], t["freq"]) == ("noaux_tc", 1) and t["ctx"] == 512
    c = _cfg(KIMI_TARGET)
    assert t["scaling"] == pytest.approx((c["qk_nope_head_dim"] + c["qk_rope_head_dim"]) ** -0.5)  # mscale 1
    assert d["arch"] == ["LlamaForCausalLMEagle3"] and d["layers"] == 1 and d["tie"] is False
    assert m["arch"] == ["Eagle3DeepseekV2ForCausalLM"] and m["layers"] == 1 and m["mla"] == "MLA"
    assert m["nextn"] >= 1  # sizes the draft KV pool (model_runner_components/spec_aux_hidden_state.py)
    assert m["rope"]["rope_type"] == "yarn" and m["tie"] is False
    for x in (d, m):
        assert x["eagle"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4] and x["draft_vocab"] == 2048


def test_kimi_llama_style_draft_follows_sglang_llama_eagle3():
    c, t = _cfg(KIMI_DRAFT), _cfg(KIMI_TARGET)
    assert c["architectures"] == ["LlamaForCausalLMEagle3"] and c["num_hidden_layers"] == 1
    assert c["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == specforge_default_layer_ids(8)
    assert c["tie_word_embeddings"] is False and c["rope_parameters"]["rope_type"] == "default"
    H, nh = t["hidden_size"], t["num_attention_heads"]
    assert (c["hidden_size"], c["num_attention_heads"], c["head_dim"]) == (H, nh, H // nh)
    w = _weights(KIMI_DRAFT)
    assert set(w) == LLAMA_DRAFT_KEYS
    assert w["fc.weight"].shape == (H, 3 * H) and w["midlayer.self_attn.q_proj.weight"].shape == (H, 2 * H)
    _check_vocab_maps(w, c, KIMI_DIR / "data")


def test_kimi_mla_draft_follows_kimi_k25_eagle3_layout():
    c, t = _cfg(KIMI_MLA), _cfg(KIMI_TARGET)
    assert c["architectures"] == ["Eagle3DeepseekV2ForCausalLM"] and c["model_type"] == "deepseek_v3"
    assert c["num_hidden_layers"] == 1 and c["num_nextn_predict_layers"] >= 1 and c["q_lora_rank"]
    assert c["tie_word_embeddings"] is False and "norm_before_fc" not in c
    assert c["rope_parameters"] == t["rope_parameters"] and c["rope_interleave"] is True
    assert c["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == specforge_default_layer_ids(8)
    w = _weights(KIMI_MLA)
    assert set(w) == MLA_DRAFT_KEYS
    H, nh = c["hidden_size"], c["num_attention_heads"]
    ql, kl, nope, rope, v = (c[k] for k in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                                            "qk_rope_head_dim", "v_head_dim"))
    shapes = {"fc.weight": (H, 3 * H), "layers.0.self_attn.q_a_proj.weight": (ql, 2 * H),
              "layers.0.self_attn.kv_a_proj_with_mqa.weight": (kl + rope, 2 * H),
              "layers.0.self_attn.q_b_proj.weight": (nh * (nope + rope), ql),
              "layers.0.self_attn.kv_b_proj.weight": (nh * (nope + v), kl),
              "layers.0.self_attn.o_proj.weight": (H, nh * v),
              "layers.0.mlp.gate_proj.weight": (c["intermediate_size"], H),
              "lm_head.weight": (c["draft_vocab_size"], H)}
    for k, s in shapes.items():
        assert tuple(w[k].shape) == s, k
    _check_vocab_maps(w, c, KIMI_DIR / "data")


def _check_vocab_maps(w: dict, c: dict, data: Path):
    V, Vd = c["vocab_size"], c["draft_vocab_size"]
    assert all(v.dtype == torch.bfloat16 for k, v in w.items() if k not in ("d2t", "t2d"))
    d2t, t2d = w["d2t"], w["t2d"]
    assert d2t.dtype == torch.int64 and d2t.shape == (Vd,) and t2d.dtype == torch.bool and t2d.shape == (V,)
    hot = d2t + torch.arange(Vd)  # SGLang: hot_token_id = d2t + arange
    assert (hot.diff() > 0).all() and int(hot.max()) < V and torch.equal(torch.nonzero(t2d)[:, 0], hot)
    for split in ("sample", "validation"):
        sd2t, st2d = read_vocab_mapping(data / split)
        assert torch.equal(sd2t, d2t) and torch.equal(st2d, t2d), split


def test_mla_draft_loads_with_sglangs_own_module(sglang_facts):
    """SGLang's Eagle3DeepseekV2ForCausalLM.load_weights on the committed checkpoint, compared tensor by tensor
    with the trainer module (tests/support/sglang_mla_draft_load.py runs in the SGLang venv)."""
    s = sglang_facts
    draft, _ = load_draft(KIMI_MLA, KIMI_TARGET)
    w = {k: v.float() for k, v in _weights(KIMI_MLA).items()}
    assert s["uninitialised"] == ["model.embed_tokens.weight"]  # shared from the target by set_embed
    p = s["params"]
    a = "model.midlayer.self_attn."
    torch.testing.assert_close(p[a + "fused_qkv_a_proj_with_mqa.weight"],
                               torch.cat([w["layers.0.self_attn.q_a_proj.weight"],
                                          w["layers.0.self_attn.kv_a_proj_with_mqa.weight"]]), rtol=0, atol=0)
    torch.testing.assert_close(p["model.midlayer.mlp.gate_up_proj.weight"],
                               torch.cat([w["layers.0.mlp.gate_proj.weight"], w["layers.0.mlp.up_proj.weight"]]),
                               rtol=0, atol=0)
    fused = {a + "fused_qkv_a_proj_with_mqa.weight", "model.midlayer.mlp.gate_up_proj.weight",
             "model.embed_tokens.weight"}
    for name, t in p.items():
        if name in fused:
            continue
        ck = re.sub(r"^model\.midlayer\.", "layers.0.", name).removeprefix("model.")
        torch.testing.assert_close(t, w[ck], rtol=0, atol=0, msg=name)
    w_kc, w_vc = draft.midlayer.absorbed_weights()
    torch.testing.assert_close(s["w_kc"], w_kc, rtol=0, atol=0)
    torch.testing.assert_close(s["w_vc"], w_vc, rtol=0, atol=0)
    assert torch.equal(s["hot_token_id"], w["d2t"].long() + torch.arange(len(w["d2t"])))
    assert s["scaling"] == pytest.approx(draft.midlayer.scaling, rel=1e-12)
    assert s["is_neox_style"] is False and s["rope_class"] == "DeepseekScalingRotaryEmbedding"
    ang = torch.arange(64, dtype=torch.float32)[:, None] * draft.midlayer.inv_freq[None, :]
    m = draft.midlayer.rope_mscale
    torch.testing.assert_close(s["cos_sin"], torch.cat([ang.cos() * m, ang.sin() * m], -1), rtol=1e-5, atol=1e-6)
    assert s["fc_norm"] is False and s["num_aux_hidden_states"] == 3


def test_mla_expanded_attention_equals_sglangs_absorbed_form():
    """The trainer's expanded MLA (k/v from kv_b_proj) and SGLang's absorbed MLA (q_nope @ w_kc against the latent,
    then @ w_vc; forward_mla.py) give the same attention output on the committed weights."""
    from e3f_models.draft import ttt_attend
    draft, _ = load_draft(KIMI_MLA, KIMI_TARGET)
    ml = draft.midlayer
    g = torch.Generator().manual_seed(0)
    T, H = 12, draft.cfg["hidden_size"]
    x = torch.randn(2, T, 2 * H, generator=g, dtype=torch.float64)
    ml = ml.double()
    pos = torch.arange(T) + 5
    causal = torch.full((T, T), float("-inf"), dtype=torch.float64).triu(1)
    with torch.no_grad():
        q_nope, q_pe, kv_a, k_pe = ml.qkv_latent(x, pos)
        k_nope, v = ml.self_attn.kv_b_proj(kv_a).view(2, T, ml.nh, ml.nope + ml.vd).split([ml.nope, ml.vd], -1)
        q = torch.cat([q_nope, q_pe], -1).transpose(1, 2)
        k = torch.cat([k_nope, k_pe.expand(-1, -1, ml.nh, -1)], -1).transpose(1, 2)
        expanded = ttt_attend(q, k, v.transpose(1, 2), [], ml.scaling, causal).transpose(1, 2).reshape(2, T, -1)
        absorbed = ml.absorbed_attention(x, pos, causal)
    torch.testing.assert_close(expanded, absorbed, rtol=1e-9, atol=1e-10)
    assert expanded.abs().max() > 1e-3


@pytest.mark.parametrize("name", list(DRAFTS))
def test_drafts_load_strictly_into_the_trainer(name):
    d, t, _ = DRAFTS[name]
    draft, head = load_draft(d, t)
    c = _cfg(d)
    assert type(draft).architecture == c["architectures"][0]
    assert head.shape == (c["vocab_size"], c["hidden_size"]) and draft.fc.in_features == 3 * c["hidden_size"]
    sd = draft.sglang_state_dict()
    w = _weights(d)
    assert set(sd) == set(w) and all(torch.equal(sd[k], w[k]) for k in w)  # export round-trips bit-exactly


def _records(folder: Path) -> list[dict]:
    return [read_record(p) for p in list_records(folder)]


@pytest.mark.parametrize("name", ["llama", "kimi", "llama_h64"])
def test_samples_and_validation_rows_are_specforge_format(name):
    d, t, data = DRAFTS[name]
    H = _cfg(t)["hidden_size"]
    log = json.loads((d / "training_log.json").read_text())
    for split in (["validation"] if name == "llama" else ["sample", "validation"]):
        folder = data / split
        files = list_records(folder)
        assert [f.relative_to(folder).as_posix() for f in files] == \
            [f"rows_0-2000/data_{i}.ckpt" for i in range(len(files))] and len(files) >= 3
        for f in files:
            r = torch.load(f, map_location="cpu", weights_only=True)
            assert set(r) == {"input_ids", "loss_mask", "aux_hidden_state", "hidden_state"}
            L = r["input_ids"].shape[0]
            assert r["input_ids"].dtype == r["loss_mask"].dtype == torch.int64
            assert r["aux_hidden_state"].shape == (1, L, 3 * H) and r["hidden_state"].shape == (1, L, H)
            assert r["aux_hidden_state"].dtype == r["hidden_state"].dtype == torch.bfloat16
            m = r["loss_mask"].tolist()
            assert m[0] == 0 and m[-1] == 1 and m == sorted(m)
        cap = json.loads((folder / "capture.json").read_text())
        assert cap["layer_ids"]["specforge_out_i"] == specforge_default_layer_ids(8)
        assert cap["target"]["model_safetensors_sha256"] == _base_sha256(t)
        if split == "validation":
            assert cap["split"] == "validation" and cap["sequences"] == "sampled at temperature 1.0"
            assert log["data"]["manifest"]["sequences"] == cap["sequences"]
            assert cap["samples"] == len(files) == len(cap["source_records"]) == len(set(cap["source_records"]))
            assert cap["training_data_samples"] == log["data"]["manifest"]["samples"]
            assert cap["validation_split_records"] == max(1, int(cap["training_data_samples"]
                                                                 * log["hyper"]["val_frac"]))
            assert cap["source_records"] == _val_split(cap["training_data_samples"], log)[:len(files)]


def _val_split(n: int, log: dict) -> list[int]:
    """train_draft.py::split_indices with the log's seed and val_frac."""
    g = torch.Generator().manual_seed(log["hyper"]["seed"])
    return torch.randperm(n, generator=g).tolist()[:max(1, int(n * log["hyper"]["val_frac"]))]


def _sha256(p: Path) -> str:
    import hashlib
    return hashlib.sha256(p.read_bytes()).hexdigest()


def _base_sha256(target: Path) -> str:
    """sha256 of the target's model.safetensors as it was before a NextN layer ``model.layers.{N}.*`` was added:
    the checkpoint without that layer re-serialised as save_pretrained writes it (safetensors, metadata format pt;
    bit-identical for the same tensors), or the file's own sha256 when it has no such layer."""
    import hashlib

    from safetensors.torch import save
    prefix = f"model.layers.{_cfg(target)['num_hidden_layers']}."
    w = _weights(target)
    if not any(k.startswith(prefix) for k in w):
        return _sha256(target / "model.safetensors")
    return hashlib.sha256(save({k: v for k, v in w.items() if not k.startswith(prefix)},
                               metadata={"format": "pt"})).hexdigest()


def _batch(recs: list[dict], transform=lambda a: a) -> dict:
    T = max(r["input_ids"].numel() for r in recs)
    W, H = recs[0]["aux_hidden_state"].shape[-1], recs[0]["hidden_state"].shape[-1]
    b = {"input_ids": torch.zeros(len(recs), T, dtype=torch.long),
         "loss_mask": torch.zeros(len(recs), T, dtype=torch.long),
         "aux_hidden_state": torch.zeros(len(recs), T, W), "hidden_state": torch.zeros(len(recs), T, H)}
    for j, r in enumerate(recs):
        L = r["input_ids"].numel()
        b["input_ids"][j, :L] = r["input_ids"]
        b["loss_mask"][j, :L] = r["loss_mask"]
        b["loss_mask"][j, L - 1] = 0
        b["aux_hidden_state"][j, :L] = transform(r["aux_hidden_state"][0].float())
        b["hidden_state"][j, :L] = r["hidden_state"][0].float()
    return b


def _reverse(a: torch.Tensor) -> torch.Tensor:
    H = a.shape[-1] // 3
    return torch.cat([a[:, 2 * H:], a[:, H:2 * H], a[:, :H]], -1)


@pytest.mark.parametrize("name", ["kimi", "kimi_mla", "llama_h64"])
def test_new_drafts_are_accurate_on_their_samples_and_need_correct_wiring(name):
    """Offline TTT accuracy on the committed greedy samples: high with the trained wiring, lower with the
    chunk order reversed."""
    d, t, data = DRAFTS[name]
    draft, head = load_draft(d, t)
    recs = _records(data / "sample")
    with torch.no_grad():
        ok = ttt_loss(draft, _batch(recs), head, 3)[1]["acc"]
        rev = ttt_loss(draft, _batch(recs, _reverse), head, 3)[1]["acc"]
    assert ok[0] >= 0.6, ok
    assert rev[0] <= ok[0] - 0.1, (ok, rev)


@pytest.mark.parametrize("name", list(DRAFTS))
def test_validation_rows_reproduce_the_recorded_evaluation(name):
    """The checkpoint's TTT accuracy on the shipped validation rows, computed here on CPU in batches of the log's
    size, agrees with what export_validation.py recorded on the training device (bf16 data, fp32 compute: only
    near-tie argmax flips may differ), and lies near the log's val_final (same split, first N rows only)."""
    import_from(MODELS, "train_draft")
    from train_draft import evaluate
    d, t, data = DRAFTS[name]
    draft, head = load_draft(d, t)
    recs = _records(data / "validation")
    cap = json.loads((data / "validation" / "capture.json").read_text())
    log = json.loads((d / "training_log.json").read_text())
    bs = log["hyper"]["batch_size"]
    batches = [list(range(i, min(i + bs, len(recs)))) for i in range(0, len(recs), bs)]
    got = evaluate(draft, recs, batches, head, log["hyper"]["ttt_length"], torch.device("cpu"))["acc_per_step"]
    rec = cap[f"eval_{d.name}"][f"first_{len(recs)}"]["acc_per_step"]
    assert max(abs(x - y) for x, y in zip(got, rec)) < 0.01, (got, rec)
    assert max(abs(x - y) for x, y in zip(got, log["val_final"]["acc_per_step"])) < 0.06, got
    assert got[0] > 0.4


def test_llama_h64_target_has_head_dim_64_and_is_a_trained_lm():
    from transformers import AutoModelForCausalLM, AutoTokenizer
    c = _cfg(H64_TARGET)
    assert c["architectures"] == ["LlamaForCausalLM"] and c["hidden_size"] == 128
    assert (c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]) == (2, 2, 64)
    d = _cfg(H64_DRAFT)
    assert (d["num_attention_heads"], d["num_key_value_heads"], d["head_dim"]) == (2, 2, 64)
    assert d["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == specforge_default_layer_ids(8)
    _check_vocab_maps(_weights(H64_DRAFT), d, LLAMA_H64_DIR / "data")
    m = AutoModelForCausalLM.from_pretrained(H64_TARGET, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(H64_TARGET)
    prompts = json.loads(PROMPTS_FILE.read_text())["prompts"][:8]
    with torch.no_grad():
        losses = [m(input_ids=x, labels=x).loss.item() for x in (torch.tensor([tok(p)["input_ids"]])
                                                                   for p in prompts)]
    assert sum(losses) / len(losses) < 6.0 and math.isfinite(losses[0])


def test_kimi_samples_reproduce_from_the_committed_target(kimi_target):
    """out(i) = HF hidden_states[i+1] = output of DeepseekV3 decoder layer i (forward hooks); recomputing the HF
    capture from the committed target gives the committed sample."""
    from e3f_models.capture import hf_capture
    ids = specforge_default_layer_ids(8)
    r = read_record(list_records(KIMI_DIR / "data" / "sample")[0])
    x = r["input_ids"][None]
    outs = {}
    hooks = [kimi_target.model.layers[i].register_forward_hook(
        lambda mod, inp, out, i=i: outs.__setitem__(i, out[0] if isinstance(out, tuple) else out)) for i in ids]
    try:
        with torch.no_grad():
            o = kimi_target.model(input_ids=x, output_hidden_states=True)
    finally:
        for h in hooks:
            h.remove()
    for i in ids:
        torch.testing.assert_close(o.hidden_states[i + 1], outs[i], rtol=0, atol=0)
    aux, last = hf_capture(kimi_target, x, ids)
    torch.testing.assert_close(aux.to(torch.bfloat16).float(), r["aux_hidden_state"].float(),
                               rtol=BF16_RTOL, atol=1e-3)
    torch.testing.assert_close(last.to(torch.bfloat16).float(), r["hidden_state"].float(),
                               rtol=BF16_RTOL, atol=1e-3)


# ---- the NextN / MTP head (env/models/train_nextn.py): the target's extra layer model.layers.8.* ------------------

#: per SGLang's NextN loader (deepseek_common/deepseek_weight_loader.py::do_load_weights, NextNEnabledConfig): these
#: names of the extra layer go to ``model.<name>``, the rest to ``model.decoder.<name>``; embed_tokens and
#: shared_head.head are skipped (the target's are shared: set_embed_and_head)
NEXTN_SPEC = ("shared_head.norm", "eh_proj", "enorm", "hnorm")


def _nextn_expected_shapes(c: dict) -> dict:
    """``model.layers.{N}.<name>`` -> shape of DeepSeek-V3's extra layer for the config ``c``."""
    H, V, E, inter = c["hidden_size"], c["vocab_size"], c["n_routed_experts"], c["moe_intermediate_size"]
    nh, qk = c["num_attention_heads"], c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    q, kv, rope, v = c["q_lora_rank"], c["kv_lora_rank"], c["qk_rope_head_dim"], c["v_head_dim"]
    shapes = {"enorm.weight": (H,), "hnorm.weight": (H,), "eh_proj.weight": (H, 2 * H),
              "shared_head.norm.weight": (H,), "shared_head.head.weight": (V, H), "embed_tokens.weight": (V, H),
              "input_layernorm.weight": (H,), "post_attention_layernorm.weight": (H,),
              "self_attn.q_a_proj.weight": (q, H), "self_attn.q_a_layernorm.weight": (q,),
              "self_attn.q_b_proj.weight": (nh * qk, q), "self_attn.kv_a_proj_with_mqa.weight": (kv + rope, H),
              "self_attn.kv_a_layernorm.weight": (kv,), "self_attn.kv_b_proj.weight": (nh * (qk - rope + v), kv),
              "self_attn.o_proj.weight": (H, nh * v), "mlp.gate.weight": (E, H),
              "mlp.gate.e_score_correction_bias": (E,),
              **{f"mlp.shared_experts.{p}_proj.weight": ((H, inter) if p == "down" else (inter, H))
                 for p in ("gate", "up", "down")},
              **{f"mlp.experts.{e}.{p}_proj.weight": ((H, inter) if p == "down" else (inter, H))
                 for e in range(E) for p in ("gate", "up", "down")}}
    return {f"model.layers.{c['num_hidden_layers']}.{k}": v for k, v in shapes.items()}


def test_nextn_head_is_deepseek_v3s_extra_layer_in_the_target_checkpoint():
    """The head ships as DeepSeek-V3 ships its MTP module: ``model.layers.8.*`` in the target's model.safetensors,
    every tensor of the expected shape (bf16; the gate's correction bias fp32, trained), embed_tokens and
    shared_head.head copies of the target's, and the first 8 layers byte-identical to the file the samples were
    captured from (capture.json's sha256 of a checkpoint without the extra layer)."""
    c, w = _cfg(KIMI_TARGET), _weights(KIMI_TARGET)
    assert c["num_nextn_predict_layers"] == 1
    prefix = f"model.layers.{c['num_hidden_layers']}."
    got = {k: tuple(v.shape) for k, v in w.items() if k.startswith(prefix)}
    assert got == _nextn_expected_shapes(c)
    for k in got:
        assert w[k].dtype == (torch.float32 if k.endswith("e_score_correction_bias") else torch.bfloat16), k
    assert torch.equal(w[prefix + "embed_tokens.weight"], w["model.embed_tokens.weight"])
    assert torch.equal(w[prefix + "shared_head.head.weight"], w["lm_head.weight"])
    assert w[prefix + "mlp.gate.e_score_correction_bias"].abs().max() > 1e-3  # balanced while training
    sha = _base_sha256(KIMI_TARGET)
    assert sha != _sha256(KIMI_TARGET / "model.safetensors")
    for split in ("sample", "validation"):
        cap = json.loads((KIMI_DIR / "data" / split / "capture.json").read_text())
        assert cap["target"]["model_safetensors_sha256"] == sha, split


def test_hf_transformers_loads_the_target_without_the_nextn_layer(kimi_target):
    """transformers 5.19's DeepseekV3ForCausalLM reports the extra layer as unexpected and builds 8 layers; its
    weights are the checkpoint's."""
    from transformers import AutoModelForCausalLM
    _, info = AutoModelForCausalLM.from_pretrained(KIMI_TARGET, dtype=torch.float32, output_loading_info=True)
    n = _cfg(KIMI_TARGET)["num_hidden_layers"]
    assert info["missing_keys"] == set() or not info["missing_keys"]
    assert info["unexpected_keys"] and all(k.startswith(f"model.layers.{n}.") for k in info["unexpected_keys"])
    assert len(kimi_target.model.layers) == n


def test_nextn_head_loads_with_sglangs_own_module_from_the_target_and_the_export(sglang_facts):
    """SGLang's own DeepseekV3ForCausalLMNextN.load_weights on the target folder (the draft path SGLang takes for
    NEXTN without --speculative-draft-model-path) and on export_nextn's folder (config num_hidden_layers 1, layer
    renamed model.layers.0, no embed/head: scripts/export_deepseek_nextn.py's layout) fills every parameter but the
    shared embedding and lm_head, each equal to the checkpoint's tensor under SGLang's name mapping (fused q_a/kv_a,
    stacked experts w13 = [gate; up], w2, shared gate_up)."""
    c, w = _cfg(KIMI_TARGET), _weights(KIMI_TARGET)
    p = f"model.layers.{c['num_hidden_layers']}."
    E = c["n_routed_experts"]
    want = {}
    for k, v in w.items():
        if not k.startswith(p) or "embed_tokens" in k or "shared_head.head" in k:
            continue
        name = k[len(p):]
        if ".experts." in name and "shared" not in name:
            continue
        want[("model." if any(s in name for s in NEXTN_SPEC) else "model.decoder.") + name] = v.float()
    d = "model.decoder."
    want[d + "self_attn.fused_qkv_a_proj_with_mqa.weight"] = torch.cat(
        [want.pop(d + "self_attn.q_a_proj.weight"), want.pop(d + "self_attn.kv_a_proj_with_mqa.weight")])
    want[d + "mlp.shared_experts.gate_up_proj.weight"] = torch.cat(
        [want.pop(d + "mlp.shared_experts.gate_proj.weight"), want.pop(d + "mlp.shared_experts.up_proj.weight")])
    want[d + "mlp.experts.w13_weight"] = torch.stack(
        [torch.cat([w[f"{p}mlp.experts.{e}.gate_proj.weight"], w[f"{p}mlp.experts.{e}.up_proj.weight"]])
         for e in range(E)]).float()
    want[d + "mlp.experts.w2_weight"] = torch.stack([w[f"{p}mlp.experts.{e}.down_proj.weight"]
                                                     for e in range(E)]).float()
    assert sglang_facts["configs"]["nextn_export"]["arch"] == ["DeepseekV3ForCausalLMNextN"]
    for src in ("target", "export"):
        f = sglang_facts["nextn"][src]
        assert f["arch"] == ["DeepseekV3ForCausalLMNextN"], src
        assert f["uninitialised"] == ["lm_head.weight", "model.embed_tokens.weight"], src  # shared from the target
        got = {k: v for k, v in f["params"].items() if k not in f["uninitialised"]}
        assert set(got) == set(want), (src, sorted(set(got) ^ set(want)))
        for k, v in want.items():
            torch.testing.assert_close(got[k], v, rtol=0, atol=0, msg=f"{src}: {k}")


def test_nextn_head_predicts_t_plus_2_on_the_validation_rows():
    """The trained head (loaded back from the bf16 checkpoint) on the Kimi drafts' validation rows (which the head's
    split left out too: rows_in_this_training_set 0 in its log): step-0 accuracy of token t+2 far above what the
    token t+1 alone gives (the target's own next-token guess at t+1 from the row's state at t, i.e. predicting
    t+2 = argmax of the target at t), within 0.01 of the accuracy recorded on the training device; the head fed
    the current instead of the next token (a served-wiring fault) loses most of it."""
    head = load_nextn(KIMI_TARGET)
    log = json.loads((KIMI_TARGET / "nextn_training_log.json").read_text())
    rows = log["validation_rows"]
    assert rows["rows_in_this_training_set"] == 0
    recs = _records(KIMI_DIR / "data" / "validation")
    import_from(MODELS, "train_draft")
    from train_draft import collate
    b = collate(recs, list(range(len(recs))), "cpu")
    lm = head.shared_head.head.weight
    with torch.no_grad():
        _, m = nextn_loss(head, b, lm, steps=1, train_steps=0)
        wrong = dict(b, input_ids=torch.cat([b["input_ids"][:, :1], b["input_ids"][:, :-1]], 1))  # token t, not t+1
        _, m_wrong = nextn_loss(head, wrong, lm, steps=1, train_steps=0)
        # baseline: the target's next-token argmax at t (its guess for t+1) taken as the guess for t+2
        mask = b["loss_mask"].float()
        t_arg1 = torch.cat([b["hidden_state"][:, 1:], b["hidden_state"][:, :1] * 0], 1) @ lm.T
        base = ((b["hidden_state"] @ lm.T).argmax(-1) == t_arg1.argmax(-1)).float()
        base_acc = float((base * mask).sum() / mask.sum())
    acc = m["acc"][0]
    assert acc > 0.3 and acc > base_acc + 0.2, (acc, base_acc)
    assert m_wrong["acc"][0] < acc - 0.15, (m_wrong, acc)
    import_from(MODELS, "train_nextn")
    from train_nextn import evaluate
    bs = log["hyper"]["batch_size"]
    batches = [list(range(i, min(i + bs, len(recs)))) for i in range(0, len(recs), bs)]
    ev = evaluate(head, recs, batches, lm, log["hyper"]["eval_steps"], torch.device("cpu"))
    # as recorded on the training device (bf16 data, fp32 compute: near-tie argmax flips only)
    assert max(abs(x - y) for x, y in zip(ev["acc_per_step"], rows["acc_per_step"])) < 0.01, (ev, rows)
