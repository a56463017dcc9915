"""A MiMo MTP head (vLLM 0.32.0 ``vllm/model_executor/models/mimo_mtp.py::MiMoMultiTokenPredictorLayer``) for the
``llama_h64`` target, trainable in torch, and the target states it reads.

What vLLM's layer computes for row t (position t, next token ``x_{t+1}``, the target's state ``h_t``)::

    e   = embed(x_{t+1}), zeroed at position 0          (MiMoMultiTokenPredictorLayer.forward: torch.where)
    x   = input_proj(cat(hidden_layernorm(h_t), token_layernorm(e)))          hidden half first
    y   = Qwen2DecoderLayer(x)                           input_layernorm, attention with q/k/v biases, neox rope, MLP
    out = final_layernorm(y + residual)                  logits = lm_head(out) (MiMoMTP.compute_logits)

``h_t`` is the target's state **before** its final norm, ``out(n-1)``: ``vllm/model_executor/models/mimo.py::
MiMoModel.forward`` returns ``hidden_states + residual`` and ``MiMoForCausalLM.compute_logits`` applies
``model.norm`` itself, so the drafter gets the pre-norm state. The embedding and lm_head are the target's (tied for
``llama_h64``: ``llm_base_proposer.py::_maybe_share_embeddings`` / ``_maybe_share_lm_head``).

The decoder layer is transformers' own ``Qwen2DecoderLayer`` (the class ``mimo_mtp.py`` builds its ``mtp_block``
from, ``Qwen2DecoderLayer`` of vLLM's ``qwen2.py``), so its parameter names are the checkpoint's
``model.mtp_layers.0.{self_attn,mlp,input_layernorm,post_attention_layernorm}.*``.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

#: the names of the head's own tensors, under ``model.mtp_layers.0.`` in a MiMo checkpoint
PREFIX = "model.mtp_layers.0."


def qwen2_config(target_cfg: dict):
    """A transformers ``Qwen2Config`` with the target's sizes (hidden, heads, MLP, rope, eps)."""
    from transformers import Qwen2Config
    keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "rms_norm_eps",
            "max_position_embeddings", "vocab_size", "rope_parameters", "hidden_act")
    c = Qwen2Config(**{k: target_cfg[k] for k in keys if k in target_cfg}, use_sliding_window=False)
    c._attn_implementation = "sdpa"
    return c


class MiMoMTPModule(nn.Module):
    """The MTP layer (module docstring) with the target's frozen embedding ``[V, H]`` and lm_head ``[V, H]``.

    ``forward(tokens [B, T] (x_{t+1} at row t), h [B, T, H] (the target's pre-norm state at t), positions [T])``
    -> ``(out [B, T, H] after final_layernorm, logits [B, T, V] float32)``. Sequences of one batch share their
    length (no padding: the causal mask is the only mask)."""

    def __init__(self, target_cfg: dict, embed: torch.Tensor, lm_head: torch.Tensor):
        super().__init__()
        from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer, Qwen2RMSNorm, Qwen2RotaryEmbedding
        self.cfg = qwen2_config(target_cfg)
        H, eps = self.cfg.hidden_size, self.cfg.rms_norm_eps
        self.token_layernorm = Qwen2RMSNorm(H, eps)
        self.hidden_layernorm = Qwen2RMSNorm(H, eps)
        self.input_proj = nn.Linear(2 * H, H, bias=False)
        self.layer = Qwen2DecoderLayer(self.cfg, layer_idx=0)
        self.final_layernorm = Qwen2RMSNorm(H, eps)
        self.rotary = Qwen2RotaryEmbedding(self.cfg)
        self.register_buffer("embed", embed.detach().float().clone(), persistent=False)
        self.register_buffer("lm_head", lm_head.detach().float().clone(), persistent=False)

    @torch.no_grad()
    def init_from_target(self, layer: nn.Module, final_norm_weight: torch.Tensor, seed: int) -> None:
        """Decoder from a copy of the target's last layer (Llama: the same names, q/k/v biases zero),
        ``hidden_layernorm`` = the target's final-norm weight (so it starts as the target's post-norm state),
        ``input_proj`` Normal(0, 0.02) from ``seed``."""
        missing, unexpected = self.layer.load_state_dict(layer.state_dict(), strict=False)
        if unexpected or any(not k.endswith(".bias") for k in missing):
            raise ValueError(f"target layer -> Qwen2 layer: missing {missing}, unexpected {unexpected}")
        for p in ("q", "k", "v"):
            getattr(self.layer.self_attn, f"{p}_proj").bias.zero_()
        self.hidden_layernorm.weight.copy_(final_norm_weight.float())
        g = torch.Generator().manual_seed(seed)
        self.input_proj.weight.copy_(torch.randn(self.input_proj.weight.shape, generator=g) * 0.02)

    def forward(self, tokens: torch.Tensor, h: torch.Tensor, positions: torch.Tensor):
        e = F.embedding(tokens, self.embed)
        e = torch.where((positions == 0)[None, :, None], torch.zeros_like(e), e)
        x = self.input_proj(torch.cat([self.hidden_layernorm(h), self.token_layernorm(e)], dim=-1))
        T = x.shape[1]
        pos = positions[None].expand(x.shape[0], T)
        cos_sin = self.rotary(x, pos)
        mask = torch.full((T, T), float("-inf"), device=x.device).triu(1)[None, None]
        y = self.layer(x, attention_mask=mask, position_ids=pos, position_embeddings=cos_sin)
        y = y[0] if isinstance(y, tuple) else y
        out = self.final_layernorm(y)           # the layer's output already holds the residual sum
        return out, F.linear(out, self.lm_head).float()

    def state_dict_mimo(self, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
        """The head's tensors under the checkpoint names vLLM's ``MiMoMTP.load_weights`` reads
        (``model.mtp_layers.0.*``), in ``dtype``."""
        out = {}
        for k, v in self.state_dict().items():
            if k.startswith("rotary."):
                continue
            name = k[len("layer."):] if k.startswith("layer.") else k
            out[PREFIX + name] = v.detach().to(dtype).contiguous()
        return out

    @torch.no_grad()
    def load_mimo(self, sd: dict[str, torch.Tensor]) -> "MiMoMTPModule":
        """Load ``model.mtp_layers.0.*`` tensors (:meth:`state_dict_mimo`'s names), upcast to float32; every
        parameter must be given.

        Raises:
            KeyError: a parameter without its tensor in ``sd``."""
        own = {"token_layernorm", "hidden_layernorm", "input_proj", "final_layernorm"}
        want = {k: v for k, v in self.state_dict().items() if not k.startswith("rotary.")}
        for k, v in want.items():
            name = PREFIX + (k[len("layer."):] if k.startswith("layer.") else k)
            if name not in sd:
                raise KeyError(f"no tensor {name}")
            v.copy_(sd[name].float())
        assert all(k.split(".")[0] in own | {"layer"} for k in want)
        return self


@torch.no_grad()
def target_states(target, ids: torch.Tensor, batch: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """``ids [N, L]`` through the transformers target -> ``(pre [N, L, H], post [N, L, H])`` float32: the output of
    the last decoder layer (``out(n-1)``, a forward hook: what vLLM hands MiMo's head) and the post-norm
    ``last_hidden_state`` (the target's next-token distribution is ``post @ lm_head^T``)."""
    pre_all, post_all = [], []
    for s in range(0, ids.shape[0], batch):
        got = {}
        hook = target.model.layers[-1].register_forward_hook(
            lambda m, i, o: got.update(x=o[0] if isinstance(o, tuple) else o))
        try:
            post = target.model(input_ids=ids[s:s + batch]).last_hidden_state
        finally:
            hook.remove()
        pre_all.append(got["x"].float())
        post_all.append(post.float())
    return torch.cat(pre_all), torch.cat(post_all)


def mtp_loss(head: MiMoMTPModule, ids: torch.Tensor, pre: torch.Tensor, post: torch.Tensor):
    """Soft cross-entropy of the head's distribution for token t+2 (row t: token t+1, state t) against the target's
    at t+1 over the full vocabulary, and top-1 agreement with the target's argmax, over rows 0..L-3 of every sequence
    (``ids [B, L]``, ``pre`` / ``post [B, L, H]``). Returns ``(loss, {"loss", "acc"})``."""
    T = ids.shape[1] - 2
    positions = torch.arange(T, device=ids.device)
    _, logits = head(ids[:, 1:T + 1], pre[:, :T], positions)
    tgt = F.linear(post[:, 1:T + 1], head.lm_head).float()
    loss = -(torch.softmax(tgt, -1) * torch.log_softmax(logits, -1)).sum(-1).mean()
    acc = (logits.argmax(-1) == tgt.argmax(-1)).float().mean()
    return loss, {"loss": float(loss.detach()), "acc": float(acc)}
