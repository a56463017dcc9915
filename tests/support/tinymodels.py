"""Tiny random Llama targets and EAGLE-3 drafts built at test time (HF ``save_pretrained``).

Used where a test needs *a* real model rather than the trained reference models in env/models/.
Shapes keep heads and KV heads divisible by 8 so the same target serves at TP 1, 2 and 8.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

WORDS = ("the quick brown fox jumps over a lazy dog while models draft tokens and targets verify "
         "them layer by layer with hidden states residual stream embedding norm attention").split()


def build_tokenizer(out: Path, vocab_size: int = 320):
    """A byte-level BPE tokenizer trained on a fixed word list; saved to ``out``."""
    import random

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    lines = [" ".join(rng.choice(WORDS) for _ in range(12)) for _ in range(1000)]
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(lines, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>")
    fast.save_pretrained(out)
    return fast


def build_target(out: Path, *, hidden: int = 64, layers: int = 8, heads: int = 8, kv_heads: int = 8,
                 vocab: int = 384, intermediate: int = 128, seed: int = 0) -> Path:
    """Save a random ``LlamaForCausalLM`` (fp32) with a tokenizer to ``out``; return ``out``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out)
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                      num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, max_position_embeddings=1024, bos_token_id=0,
                      eos_token_id=1, pad_token_id=2, tie_word_embeddings=False,
                      torch_dtype="float32")
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # larger weights than the default init, so layers differ clearly
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
    model.save_pretrained(out)
    return out


def build_eagle3_draft(out: Path, target_dir: Path, *, layer_ids=None, draft_vocab: int = 256,
                       nested: bool = True, seed: int = 1, intermediate: int = 128,
                       hidden: int | None = None, write_target_hidden_size: bool = True,
                       with_d2t: bool = True, num_aux: int = 3) -> Path:
    """Save a random EAGLE-3 draft in SGLang's ``LlamaForCausalLMEagle3`` layout.

    ``layer_ids`` (SpecForge output-of-layer convention) go under ``eagle_config`` when
    ``nested`` else at the top level (which SGLang ignores); None writes no ids.
    ``hidden`` sets a draft hidden size different from the target's (``fc`` is then
    ``[hidden, num_aux * H_target]``); ``target_hidden_size`` is written unless
    ``write_target_hidden_size`` is False. ``with_d2t=False`` leaves out d2t/t2d.
    """
    from safetensors.torch import save_file

    tcfg = json.loads((Path(target_dir) / "config.json").read_text())
    ht, v = tcfg["hidden_size"], tcfg["vocab_size"]
    h = hidden or ht
    nh, nkv = tcfg["num_attention_heads"], tcfg["num_key_value_heads"]
    hd = h // nh
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": h,
           "intermediate_size": intermediate, "num_hidden_layers": 1, "num_attention_heads": nh,
           "num_key_value_heads": nkv, "vocab_size": v, "draft_vocab_size": draft_vocab,
           "max_position_embeddings": tcfg["max_position_embeddings"], "rms_norm_eps": 1e-6,
           "rope_theta": tcfg.get("rope_theta", 10000.0), "hidden_act": "silu",
           "tie_word_embeddings": False, "torch_dtype": "float32", "bos_token_id": 0,
           "eos_token_id": 1}
    if h != ht and write_target_hidden_size:
        cfg["target_hidden_size"] = ht
    if layer_ids is not None:
        if nested:
            cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(layer_ids),
                                   "use_aux_hidden_state": True}
        else:
            cfg["eagle_aux_hidden_state_layer_ids"] = list(layer_ids)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g) * 0.05

    w = {"fc.weight": r(h, num_aux * ht),
         "midlayer.self_attn.q_proj.weight": r(nh * hd, 2 * h),
         "midlayer.self_attn.k_proj.weight": r(nkv * hd, 2 * h),
         "midlayer.self_attn.v_proj.weight": r(nkv * hd, 2 * h),
         "midlayer.self_attn.o_proj.weight": r(h, nh * hd),
         "midlayer.mlp.gate_proj.weight": r(intermediate, h),
         "midlayer.mlp.up_proj.weight": r(intermediate, h),
         "midlayer.mlp.down_proj.weight": r(h, intermediate),
         "midlayer.input_layernorm.weight": torch.ones(h),
         "midlayer.hidden_norm.weight": torch.ones(h),
         "midlayer.post_attention_layernorm.weight": torch.ones(h),
         "norm.weight": torch.ones(h),
         "lm_head.weight": r(draft_vocab, h),
         "d2t": torch.zeros(draft_vocab, dtype=torch.int64),
         "t2d": torch.zeros(v, dtype=torch.bool)}
    w["t2d"][:draft_vocab] = True
    if not with_d2t:
        del w["d2t"], w["t2d"]
    save_file(w, os.fspath(out / "model.safetensors"))
    return out
