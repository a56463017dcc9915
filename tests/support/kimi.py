"""Tiny random Kimi-class models built at test time: a ``DeepseekV3ForCausalLM`` target (MLA, routed experts with a
shared expert, ``noaux_tc`` sigmoid router) and its two EAGLE-3 drafts (``LlamaForCausalLMEagle3`` and the MLA draft
``Eagle3DeepseekV2ForCausalLM``), in the layouts SGLang 0.5.23 loads.

The target is HF transformers 5.19's ``DeepseekV3ForCausalLM`` saved with ``save_pretrained``, plus the config keys
SGLang's ``sglang/srt/models/deepseek_v2.py`` reads and transformers does not define (``moe_layer_freq``,
``topk_method``, ``scoring_func``); RoPE is yarn with factor 1 (plain RoPE on both sides: SGLang's CPU RoPE accepts
only ``deepseek_yarn``, ``sglang/srt/layers/rotary_embedding/factory.py::get_rope_cpu``) and interleaved
(``rope_interleave``; SGLang's CPU RoPE is ``is_neox=False``). The MLA draft follows
``sglang/srt/models/kimi_k25_eagle3.py::Eagle3DeepseekV2ForCausalLM.load_weights`` (``layers.0.*`` keys, separate
``q_a_proj`` / ``kv_a_proj_with_mqa`` of input width 2H, which SGLang fuses).

Used until the trained Kimi-class models (env/models/kimi/) exist, and for tests that need a target of this family
with other ids.
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import torch

from . import ROOT

#: the reference tokenizer (vocab 4096), shared with the Llama reference models
TOKENIZER_DIR = ROOT / "env" / "models" / "target"

#: the tiny Kimi-class shape (hidden 128, 8 layers, 8 routed experts top-2 + 1 shared, first layer dense)
KIMI_SHAPE = dict(vocab_size=4096, hidden_size=128, intermediate_size=384, moe_intermediate_size=64,
                  num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8, n_shared_experts=1,
                  n_routed_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
                  routed_scaling_factor=2.827, norm_topk_prob=True, q_lora_rank=64, kv_lora_rank=64,
                  qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, max_position_embeddings=512,
                  rms_norm_eps=1e-6)

#: keys SGLang's deepseek_v2.py reads that transformers' DeepseekV3Config does not define
SGLANG_KEYS = dict(moe_layer_freq=1, topk_method="noaux_tc", scoring_func="sigmoid")


def yarn_rope(max_position: int, theta: float = 10000.0) -> dict:
    """Yarn ``rope_parameters`` with factor 1 (= plain RoPE), what SGLang's CPU RoPE accepts."""
    return {"rope_type": "yarn", "rope_theta": theta, "factor": 1.0,
            "original_max_position_embeddings": max_position, "beta_fast": 32.0, "beta_slow": 1.0,
            "mscale": 1.0, "mscale_all_dim": 1.0}


def _copy_tokenizer(out: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKENIZER_DIR / name, out / name)


def build_deepseek_target(out: Path, *, seed: int = 0, std: float = 0.08, bias_std: float = 0.3,
                          **shape) -> Path:
    """Save a random fp32 ``DeepseekV3ForCausalLM`` (``KIMI_SHAPE`` unless overridden) with the reference tokenizer
    to ``out``; return ``out``. Weights are N(0, ``std``) (larger than the default init, so layers differ clearly);
    the router's ``e_score_correction_bias`` is a fixed non-zero N(0, ``bias_std``) so the bias path is exercised."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    _copy_tokenizer(out)
    torch.manual_seed(seed)
    dims = {**KIMI_SHAPE, **shape}
    cfg = DeepseekV3Config(**dims, rope_parameters=yarn_rope(dims["max_position_embeddings"]), rope_interleave=True,
                           bos_token_id=0, eos_token_id=1, pad_token_id=2, tie_word_embeddings=False,
                           **SGLANG_KEYS)
    cfg.architectures = ["DeepseekV3ForCausalLM"]
    model = DeepseekV3ForCausalLM(cfg).float()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("e_score_correction_bias"):
                p.copy_(torch.randn(p.shape, generator=g) * bias_std)
            elif p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    model.save_pretrained(out)
    return out


def _r(g: torch.Generator, *shape: int, std: float = 0.05) -> torch.Tensor:
    return torch.randn(*shape, generator=g) * std


def _draft_config_common(tcfg: dict, layer_ids: Optional[Sequence[int]], draft_vocab: int) -> dict:
    cfg = {"num_hidden_layers": 1, "vocab_size": tcfg["vocab_size"], "draft_vocab_size": draft_vocab,
           "hidden_size": tcfg["hidden_size"], "max_position_embeddings": tcfg["max_position_embeddings"],
           "rms_norm_eps": tcfg.get("rms_norm_eps", 1e-6), "hidden_act": "silu", "tie_word_embeddings": False,
           "torch_dtype": "float32", "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2}
    if layer_ids is not None:
        cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(layer_ids), "use_aux_hidden_state": True}
    return cfg


def _vocab_maps(v: int, draft_vocab: int) -> dict[str, torch.Tensor]:
    t2d = torch.zeros(v, dtype=torch.bool)
    t2d[:draft_vocab] = True
    return {"d2t": torch.zeros(draft_vocab, dtype=torch.int64), "t2d": t2d}


def build_mla_draft(out: Path, target_dir: Path, *, layer_ids: Optional[Sequence[int]] = (1, 3, 4),
                    draft_vocab: int = 2048, intermediate: int = 384, seed: int = 1,
                    config_overrides: Optional[dict] = None) -> Path:
    """Save a random EAGLE-3 MLA draft (``Eagle3DeepseekV2ForCausalLM``, ``model_type`` deepseek_v3) for the
    DeepSeek target in ``target_dir``, in the checkpoint layout
    ``sglang/srt/models/kimi_k25_eagle3.py::Eagle3DeepseekV2ForCausalLM.load_weights`` reads:
    ``layers.0.self_attn.{q_a_proj [q_lora, 2H], q_a_layernorm, q_b_proj, kv_a_proj_with_mqa [kv_lora + rope, 2H],
    kv_a_layernorm, kv_b_proj, o_proj}``, ``layers.0.mlp.{gate,up,down}_proj``, ``layers.0.{input_layernorm,
    hidden_norm, post_attention_layernorm}``, ``fc [H, len(ids) * H]``, ``norm``, ``lm_head [draft_vocab, H]``,
    ``d2t`` int64 / ``t2d`` bool (no ``embed_tokens``: SGLang shares the target's). ``config_overrides`` are merged
    into config.json last (for bad-config tests)."""
    from safetensors.torch import save_file

    tcfg = json.loads((Path(target_dir) / "config.json").read_text())
    h, v = tcfg["hidden_size"], tcfg["vocab_size"]
    nh = tcfg["num_attention_heads"]
    ql, kl = tcfg["q_lora_rank"], tcfg["kv_lora_rank"]
    nope, rope, vd = tcfg["qk_nope_head_dim"], tcfg["qk_rope_head_dim"], tcfg["v_head_dim"]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = {"architectures": ["Eagle3DeepseekV2ForCausalLM"], "model_type": "deepseek_v3",
           **_draft_config_common(tcfg, layer_ids, draft_vocab), "intermediate_size": intermediate,
           "num_attention_heads": nh, "num_key_value_heads": nh, "q_lora_rank": ql, "kv_lora_rank": kl,
           "qk_nope_head_dim": nope, "qk_rope_head_dim": rope, "v_head_dim": vd,
           "rope_parameters": yarn_rope(tcfg["max_position_embeddings"]), "rope_interleave": True,
           # model_type deepseek_v3 builds a DeepseekV3Config: MoE fields it requires, unused by the dense draft
           "n_routed_experts": tcfg["n_routed_experts"], "num_experts_per_tok": tcfg["num_experts_per_tok"],
           "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1, "moe_intermediate_size": 64,
           "num_nextn_predict_layers": 1, **SGLANG_KEYS}
    cfg.update(config_overrides or {})
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    g = torch.Generator().manual_seed(seed)
    n_aux = len(layer_ids) if layer_ids is not None else 3
    p = "layers.0."
    w = {"fc.weight": _r(g, h, n_aux * h),
         p + "self_attn.q_a_proj.weight": _r(g, ql, 2 * h),
         p + "self_attn.q_a_layernorm.weight": torch.ones(ql),
         p + "self_attn.q_b_proj.weight": _r(g, nh * (nope + rope), ql),
         p + "self_attn.kv_a_proj_with_mqa.weight": _r(g, kl + rope, 2 * h),
         p + "self_attn.kv_a_layernorm.weight": torch.ones(kl),
         p + "self_attn.kv_b_proj.weight": _r(g, nh * (nope + vd), kl),
         p + "self_attn.o_proj.weight": _r(g, h, nh * vd),
         p + "mlp.gate_proj.weight": _r(g, intermediate, h),
         p + "mlp.up_proj.weight": _r(g, intermediate, h),
         p + "mlp.down_proj.weight": _r(g, h, intermediate),
         p + "input_layernorm.weight": torch.ones(h),
         p + "hidden_norm.weight": torch.ones(h),
         p + "post_attention_layernorm.weight": torch.ones(h),
         "norm.weight": torch.ones(h),
         "lm_head.weight": _r(g, draft_vocab, h),
         **_vocab_maps(v, draft_vocab)}
    save_file(w, os.fspath(out / "model.safetensors"))
    return out


def build_llama_draft(out: Path, target_dir: Path, *, layer_ids: Optional[Sequence[int]] = (1, 3, 4),
                      draft_vocab: int = 2048, intermediate: int = 384, seed: int = 2) -> Path:
    """Save a random ``LlamaForCausalLMEagle3`` draft for the DeepSeek target in ``target_dir`` (the layout of
    ``sglang/srt/models/llama_eagle3.py``: ``midlayer.*`` with q/k/v of input width 2H, ``fc``, ``norm``,
    ``lm_head``, ``d2t`` / ``t2d``); 8 heads of 16, plain RoPE (a Llama draft's RoPE is not the target's)."""
    from safetensors.torch import save_file

    tcfg = json.loads((Path(target_dir) / "config.json").read_text())
    h, v, nh = tcfg["hidden_size"], tcfg["vocab_size"], tcfg["num_attention_heads"]
    hd = h // nh
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
           **_draft_config_common(tcfg, layer_ids, draft_vocab), "intermediate_size": intermediate,
           "num_attention_heads": nh, "num_key_value_heads": nh, "head_dim": hd, "rope_theta": 10000.0,
           "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}}
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    g = torch.Generator().manual_seed(seed)
    n_aux = len(layer_ids) if layer_ids is not None else 3
    w = {"fc.weight": _r(g, h, n_aux * h),
         "midlayer.self_attn.q_proj.weight": _r(g, nh * hd, 2 * h),
         "midlayer.self_attn.k_proj.weight": _r(g, nh * hd, 2 * h),
         "midlayer.self_attn.v_proj.weight": _r(g, nh * hd, 2 * h),
         "midlayer.self_attn.o_proj.weight": _r(g, h, nh * hd),
         "midlayer.mlp.gate_proj.weight": _r(g, intermediate, h),
         "midlayer.mlp.up_proj.weight": _r(g, intermediate, h),
         "midlayer.mlp.down_proj.weight": _r(g, h, intermediate),
         "midlayer.input_layernorm.weight": torch.ones(h),
         "midlayer.hidden_norm.weight": torch.ones(h),
         "midlayer.post_attention_layernorm.weight": torch.ones(h),
         "norm.weight": torch.ones(h),
         "lm_head.weight": _r(g, draft_vocab, h),
         **_vocab_maps(v, draft_vocab)}
    save_file(w, os.fspath(out / "model.safetensors"))
    return out


# ---------------------------------------------------------------------------------------------- the models tests use
#: the trained Kimi-class models (env/models/kimi/, made by env/models' trainers), when present
TRAINED = ROOT / "env" / "models" / "kimi"


@dataclass(frozen=True)
class KimiModels:
    """The Kimi-class target and its two EAGLE-3 drafts a test serves: ``trained`` (env/models/kimi/) or random."""

    target: Path
    llama_draft: Path
    mla_draft: Path
    trained: bool


def kimi_models(scratch: Path) -> KimiModels:
    """The trained models of :data:`TRAINED` when all three folders hold a config.json, else random ones of the same
    shapes built under ``scratch`` (target seed 0, drafts with ids [1, 3, 4])."""
    t, d, m = TRAINED / "target", TRAINED / "draft", TRAINED / "draft_mla"
    if all((p / "config.json").is_file() for p in (t, d, m)):
        return KimiModels(t, d, m, True)
    scratch = Path(scratch)
    target = build_deepseek_target(scratch / "target")
    return KimiModels(target, build_llama_draft(scratch / "llama-draft", target),
                      build_mla_draft(scratch / "mla-draft", target), False)


def hf_layers(model, ids: Sequence[int]) -> dict[str, torch.Tensor]:
    """Every layer of an HF causal LM for one sequence: ``{"embedding": [T, H], "out(0)": ..., "out(n-1)": ...}``
    (fp32; out(L) = HF ``hidden_states[L+1]`` for L < n-1, out(n-1) = the input of ``model.norm``, since HF's last
    entry is after the final norm) and ``"mlp(L)"``: each layer's MLP (or MoE) block output, the sum SGLang's ranks
    hold partials of."""
    got: dict[str, torch.Tensor] = {}
    hooks = [model.model.norm.register_forward_pre_hook(lambda m, a: got.__setitem__("pre_norm", a[0][0].detach()))]
    for L, layer in enumerate(model.model.layers):
        hooks.append(layer.mlp.register_forward_hook(
            lambda m, a, o, L=L: got.__setitem__(f"mlp({L})", (o[0] if isinstance(o, tuple) else o)[0].detach())))
    try:
        with torch.no_grad():
            hs = model(torch.tensor([list(ids)]), output_hidden_states=True).hidden_states
    finally:
        for h in hooks:
            h.remove()
    n = len(model.model.layers)
    out = {"embedding": hs[0][0].float()}
    out.update({f"out({L})": hs[L + 1][0].float() for L in range(n - 1)})
    out[f"out({n - 1})"] = got.pop("pre_norm").float()
    out.update({k: v.float() for k, v in got.items()})
    return out


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| over the whole tensor (float64)."""
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def identify(chunk: torch.Tensor, layers: dict[str, torch.Tensor]) -> tuple[str, float]:
    """The residual-stream tensor (``embedding`` / ``out(L)``) of ``layers`` closest to ``chunk``, and its rel diff."""
    names = [k for k in layers if k == "embedding" or k.startswith("out(")]
    best = min(names, key=lambda k: rel_diff(chunk, layers[k]))
    return best, rel_diff(chunk, layers[best])
