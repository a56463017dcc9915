"""EAGLE-1 draft for vLLM 0.32.0's ``method: eagle`` (``vllm/model_executor/models/llama_eagle.py``), built from
transformers' own ``LlamaDecoderLayer`` so the training module is independent of ``helpers.draft.eagle1``.

vLLM's forward (``llama_eagle.py::LlamaModel.forward``; layer 0 has ``input_layernorm = nn.Identity()``)::

    x   = fc(cat(embed_tokens(x_{t+1}), h_t))        [2H] -> [H], no bias, no norms, embedding half first
    y   = decoder layers (layer 0 without input_layernorm), rotary position t
    out = y + residual                                no final norm: ``return hidden_states, hidden_states``
    logits = lm_head(out)                             the target's lm_head (``_maybe_share_lm_head``)

``h_t`` is the target's hidden state after its final norm (``llama.py::LlamaModel.forward`` returns
``self.norm(hidden_states, residual)``; ``gpu_model_runner.py`` hands ``hidden_states[:num_scheduled_tokens]`` to
``drafter.propose`` when ``use_aux_hidden_state_outputs`` is False, i.e. for every method but eagle3 / dflash).
Later draft steps feed ``out`` back as ``h``. Checkpoint names (``EagleLlamaForCausalLM.load_weights`` prefixes
``model.``): ``fc.weight``, ``layers.{i}.*`` (q/k/v/o_proj, gate/up/down_proj, post_attention_layernorm, and
input_layernorm for i > 0 only); ``embed_tokens`` and ``lm_head`` left out so vLLM shares the target's.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


def eagle1_config(tcfg: dict, layers: int = 1) -> dict:
    """config.json of the draft: the target's Llama shape with ``num_hidden_layers`` = ``layers`` and architecture
    ``EagleLlamaForCausalLM`` (vLLM's ``EAGLEConfig`` keeps an ``Eagle`` prefix as is)."""
    keep = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "hidden_act", "max_position_embeddings", "rms_norm_eps", "rope_parameters", "attention_bias",
            "mlp_bias", "vocab_size", "bos_token_id", "eos_token_id", "pad_token_id")
    cfg = {"architectures": ["EagleLlamaForCausalLM"], "model_type": "llama"}
    cfg.update({k: tcfg[k] for k in keep if k in tcfg})
    cfg.update({"num_hidden_layers": layers, "tie_word_embeddings": False, "torch_dtype": "bfloat16"})
    return cfg


class Eagle1Module(nn.Module):
    """Trainable EAGLE-1 draft: ``fc`` + transformers ``LlamaDecoderLayer`` s (layer 0's input_layernorm replaced by
    ``nn.Identity``); ``embed`` and ``lm_head`` are the target's, frozen buffers."""

    def __init__(self, cfg: dict, embed: torch.Tensor, lm_head: torch.Tensor):
        super().__init__()
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding
        hc = LlamaConfig(**{k: v for k, v in cfg.items() if k not in ("architectures", "torch_dtype")})
        hc._attn_implementation = "sdpa"
        H = cfg["hidden_size"]
        self.fc = nn.Linear(2 * H, H, bias=False)
        self.layers = nn.ModuleList([LlamaDecoderLayer(hc, i) for i in range(cfg["num_hidden_layers"])])
        self.layers[0].input_layernorm = nn.Identity()
        self.rotary = LlamaRotaryEmbedding(hc)
        self.register_buffer("embed", embed.float(), persistent=False)
        self.register_buffer("lm_head", lm_head.float(), persistent=False)

    def forward(self, next_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor | None = None):
        """``next_ids [B, T]`` (row t: token t+1), ``hidden [B, T, H]`` (row t: state of t) -> ``(out [B, T, H],
        logits [B, T, V])``, causal over rows."""
        B, T = next_ids.shape
        pos = torch.arange(T, device=next_ids.device)[None].expand(B, T) if positions is None else positions
        x = self.fc(torch.cat([self.embed[next_ids], hidden], dim=-1))
        pe = self.rotary(x, pos)
        for layer in self.layers:
            x = layer(x, attention_mask=None, position_ids=pos, position_embeddings=pe)
            x = x[0] if isinstance(x, tuple) else x
        return x, F.linear(x, self.lm_head)

    def vllm_state_dict(self, dtype=torch.bfloat16) -> dict:
        """The names ``EagleLlamaForCausalLM.load_weights`` reads (it adds ``model.``); no embed_tokens / lm_head."""
        out = {"fc.weight": self.fc.weight}
        for i, layer in enumerate(self.layers):
            for n, p in layer.named_parameters():
                out[f"layers.{i}.{n}"] = p
        return {k: v.detach().to(dtype).contiguous() for k, v in out.items()}
