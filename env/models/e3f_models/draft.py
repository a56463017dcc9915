"""EAGLE-3 draft model and a compact training-time-test (TTT) trainer.

The module mirrors two sources, and its weights use their shared names:

* SpecForge's draft (sgl-project/SpecForge @a6b6b023,
  ``specforge/modeling/draft/llama3_eagle.py::LlamaForCausalLMEagle3``) and its offline trainer
  (``specforge/algorithms/eagle3/model.py`` forward, ``specforge/core/eagle3_adapters.py``,
  ``specforge/modeling/target/target_head.py::preprocess``);
* SGLang's serving model (sglang 0.5.23 ``srt/models/llama_eagle3.py``), which loads
  ``fc.weight``, ``midlayer.*`` (renamed to ``layers.0.*``), ``norm.weight``, ``lm_head.weight``
  and ``d2t`` (``hot_token_id = d2t + arange``); ``t2d`` is ignored there; ``embed_tokens`` is
  shared from the target at load time (``set_embed``), so it is not saved.

Forward of one draft step (SGLang ``LlamaDecoderLayer`` with ``is_input_layer``):
  ``h_in`` = ``fc(aux)`` (target aux hidden states, [.., 3H] -> [.., H]) on the first step, the
  draft's own pre-norm output afterwards; ``x = cat(input_layernorm(embed(tok)), hidden_norm(h_in))``
  ([.., 2H]) -> attention (q/k/v take 2H) -> ``h = h_in + o_proj(..)`` -> ``h = h + mlp(
  post_attention_layernorm(h))``; logits = ``lm_head(norm(h))`` over the draft vocabulary.

TTT (``ttt_loss``), as in SpecForge HEAD: inputs are shifted by one (row t pairs token t+1 with
the target's aux state at t and is trained on the target's next-token distribution at t+1, i.e.
for token t+2). Step k feeds the step k-1 output back at the same row, shifts the ids by one more,
uses rotary positions ``t + k``, and attends to the step-0 keys causally (diagonal included; the
flex/flash backends of SpecForge HEAD, not the old SDPA path that also masked the diagonal) plus
its own row in every earlier step (the "diagonal" cache). Loss of step k: soft cross-entropy
against ``softmax(target_logits[t2d])`` on rows whose loss mask is 1 and whose target argmax is in
the draft vocabulary, weighted ``0.8**k``.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class RMSNorm(nn.Module):
    def __init__(self, h: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(h))
        self.eps = eps

    def forward(self, x):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def _rope(x, pos, theta: float):
    """Llama rotary embedding (rotate_half form) of ``x [B, nh, T, hd]`` at positions ``pos [T]``."""
    hd = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, hd, 2, device=x.device, dtype=torch.float32) / hd))
    ang = pos.to(torch.float32)[:, None] * inv[None, :]
    emb = torch.cat([ang, ang], dim=-1)
    cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
    x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def ttt_attend(q, k, v, cache: list, scale: float, causal_bias):
    """Attention of one TTT step: causal over the step-0 keys plus each row's own key of every
    later step (SpecForge HEAD's TTT mask). ``q``/``k`` [B, nh, T, Dqk], ``v`` [B, nh, T, Dv];
    ``cache`` list of ``(k, v)`` of earlier steps (step 0 first), this step's appended in place;
    ``causal_bias`` [T, T] additive. Returns ``[B, nh, T, Dv]``."""
    T = q.shape[-2]
    cache.append((k, v))
    k0, v0 = cache[0]
    s0 = torch.matmul(q, k0.transpose(-1, -2)) * scale + causal_bias  # [B, nh, T, T]
    sd = [(q * kj).sum(-1, keepdim=True) * scale for kj, _ in cache[1:]]  # [B, nh, T, 1]
    w = torch.softmax(torch.cat([s0] + sd, dim=-1).float(), dim=-1).to(q.dtype)
    out = torch.matmul(w[..., :T], v0)
    for j, (_, vj) in enumerate(cache[1:]):
        out = out + w[..., T + j:T + j + 1] * vj
    return out


class MidLayer(nn.Module):
    """The single EAGLE-3 decoder layer (``midlayer.*``)."""

    def __init__(self, cfg: dict):
        super().__init__()
        h, nh, nkv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
        hd = cfg.get("head_dim") or h // nh
        inter, eps = cfg["intermediate_size"], cfg["rms_norm_eps"]
        self.nh, self.nkv, self.hd = nh, nkv, hd
        self.theta = cfg["rope_theta"]
        self.input_layernorm = RMSNorm(h, eps)
        self.hidden_norm = RMSNorm(h, eps)
        self.post_attention_layernorm = RMSNorm(h, eps)
        attn = nn.Module()
        attn.q_proj = nn.Linear(2 * h, nh * hd, bias=False)
        attn.k_proj = nn.Linear(2 * h, nkv * hd, bias=False)
        attn.v_proj = nn.Linear(2 * h, nkv * hd, bias=False)
        attn.o_proj = nn.Linear(nh * hd, h, bias=False)
        self.self_attn = attn
        mlp = nn.Module()
        mlp.gate_proj = nn.Linear(h, inter, bias=False)
        mlp.up_proj = nn.Linear(h, inter, bias=False)
        mlp.down_proj = nn.Linear(inter, h, bias=False)
        self.mlp = mlp

    def forward(self, embeds, hidden, cache: list, pos, causal_bias):
        """One TTT step. ``embeds``/``hidden`` [B, T, H]; ``cache`` list of (k, v) of earlier
        steps (step 0 first), appended in place; ``pos`` [T] rotary positions; ``causal_bias``
        [T, T] additive mask for the step-0 keys. Returns the pre-norm output [B, T, H]."""
        B, T, _ = hidden.shape
        residual = hidden
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        a = self.self_attn
        q = a.q_proj(x).view(B, T, self.nh, self.hd).transpose(1, 2)
        k = a.k_proj(x).view(B, T, self.nkv, self.hd).transpose(1, 2)
        v = a.v_proj(x).view(B, T, self.nkv, self.hd).transpose(1, 2)
        q, k = _rope(q, pos, self.theta), _rope(k, pos, self.theta)
        rep = self.nh // self.nkv
        if rep > 1:
            k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        out = ttt_attend(q, k, v, cache, 1.0 / math.sqrt(self.hd), causal_bias)
        out = out.transpose(1, 2).reshape(B, T, self.nh * self.hd)
        h = residual + a.o_proj(out)
        m = self.mlp
        y = self.post_attention_layernorm(h)
        return h + m.down_proj(F.silu(m.gate_proj(y)) * m.up_proj(y))


class Eagle3Draft(nn.Module):
    """EAGLE-3 draft (SGLang ``LlamaForCausalLMEagle3``) with a frozen copy of the target's input
    embedding. ``midlayer_cls``: the decoder layer (``MidLayer``; the MLA draft overrides it)."""

    midlayer_cls = MidLayer
    architecture = "LlamaForCausalLMEagle3"

    def __init__(self, cfg: dict, embed_weight: torch.Tensor, d2t: torch.Tensor,
                 t2d: torch.Tensor):
        super().__init__()
        h = cfg["hidden_size"]
        th = cfg.get("target_hidden_size") or h
        n_aux = len(cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
        self.cfg = cfg
        self.n_aux = n_aux
        self.embed = nn.Embedding.from_pretrained(embed_weight.float().clone(), freeze=True)
        self.fc = nn.Linear(n_aux * th, h, bias=False)
        self.midlayer = self.midlayer_cls(cfg)
        self.norm = RMSNorm(h, cfg["rms_norm_eps"])
        self.lm_head = nn.Linear(h, cfg["draft_vocab_size"], bias=False)
        self.register_buffer("d2t", d2t.to(torch.long).clone())
        self.register_buffer("t2d", t2d.to(torch.bool).clone())

    def init_weights(self, seed: int, std: float = 0.02, lm_head_from: torch.Tensor | None = None):
        """Normal(0, std) linears (HF Llama init), ones for norms; optionally start ``lm_head``
        from the target's output rows of the draft vocabulary (``lm_head_from [V, H]``)."""
        g = torch.Generator().manual_seed(seed)
        for mod in self.modules():
            if isinstance(mod, nn.Linear):
                with torch.no_grad():
                    mod.weight.copy_(torch.randn(mod.weight.shape, generator=g) * std)
        if lm_head_from is not None:
            used = torch.arange(len(self.d2t)) + self.d2t.cpu()
            with torch.no_grad():
                self.lm_head.weight.copy_(lm_head_from[used].float())

    def aux_to_hidden(self, aux: torch.Tensor) -> torch.Tensor:
        """``fc`` over the concatenated aux chunks ``[.., n_aux * H_target]`` -> ``[.., H]``."""
        return self.fc(aux)

    @staticmethod
    def checkpoint_name(name: str) -> str:
        """Module parameter name -> checkpoint name (identity: SpecForge / SGLang use
        ``midlayer.*``, which ``llama_eagle3.py::load_weights`` maps itself)."""
        return name

    def sglang_state_dict(self, dtype=torch.bfloat16) -> dict:
        """Weights under SpecForge / SGLang names (no ``embed_tokens``; d2t int64, t2d bool)."""
        out = {}
        for k, v in self.state_dict().items():
            if k.startswith("embed."):
                continue
            if k in ("d2t", "t2d"):
                out[self.checkpoint_name(k)] = v.detach().cpu().clone()
            else:
                out[self.checkpoint_name(k)] = v.detach().cpu().to(dtype).contiguous()
        return out

    def load_sglang_state_dict(self, w: dict) -> None:
        """Load a checkpoint written by ``sglang_state_dict`` (fp32 upcast), strictly: every
        module tensor but the shared embedding must be present, and nothing else.
        Raises ValueError naming the missing / unexpected keys."""
        own = {self.checkpoint_name(k): k for k in self.state_dict() if not k.startswith("embed.")}
        missing = sorted(set(own) - set(w))
        unexpected = sorted(set(w) - set(own))
        if missing or unexpected:
            raise ValueError(f"draft checkpoint: missing {missing}, unexpected {unexpected} "
                             f"(expected {self.architecture} names)")
        sd = {own[k]: (v.float() if v.is_floating_point() else v) for k, v in w.items()}
        res = self.load_state_dict(sd, strict=False)
        assert res.missing_keys == ["embed.weight"] and not res.unexpected_keys, res


def llama_draft_config(target_cfg: dict, draft_vocab: int, layer_ids: list[int]) -> dict:
    """config.json of a Llama-style draft (SGLang ``LlamaForCausalLMEagle3`` / SpecForge draft
    config) for the target whose config.json dict is ``target_cfg``.

    One decoder layer of the shape the target's family gives (``TargetFamily.draft_shape``: for a
    Llama target its own heads / head_dim / MLP / RoPE theta), ``draft_vocab_size`` <
    ``vocab_size``, ``tie_word_embeddings: false`` (SGLang would otherwise use the embedding as
    lm_head) and ``eagle_config.eagle_aux_hidden_state_layer_ids`` in SpecForge's out(i)
    convention: SGLang reads the nested key (model_runner_components/spec_aux_hidden_state.py)
    and captures at loop index i+1 (models/llama.py::set_eagle3_layers_to_capture; the DeepSeek
    family's deepseek_v2.py::set_eagle3_layers_to_capture adds +1 when the first id is 1).
    """
    from .target import family_of
    sh = family_of(target_cfg).draft_shape(target_cfg)
    rope = sh["rope_theta"]
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": sh["hidden_size"],
        "intermediate_size": sh["intermediate_size"],
        "num_hidden_layers": 1,
        "num_attention_heads": sh["num_attention_heads"],
        "num_key_value_heads": sh["num_key_value_heads"],
        "head_dim": sh["head_dim"],
        "hidden_act": sh["hidden_act"],
        "max_position_embeddings": sh["max_position_embeddings"],
        "rms_norm_eps": sh["rms_norm_eps"],
        "rope_theta": rope,
        "rope_parameters": {"rope_theta": rope, "rope_type": "default"},
        "attention_bias": False,
        "mlp_bias": False,
        "vocab_size": target_cfg["vocab_size"],
        "draft_vocab_size": int(draft_vocab),
        "tie_word_embeddings": False,
        "bos_token_id": target_cfg.get("bos_token_id"),
        "eos_token_id": target_cfg.get("eos_token_id"),
        "pad_token_id": target_cfg.get("pad_token_id"),
        "torch_dtype": "bfloat16",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(layer_ids),
                         "use_aux_hidden_state": True},
    }


def _shift_left(x: torch.Tensor, n: int = 1) -> torch.Tensor:
    """``x[:, t] <- x[:, t + n]``, zero-filled at the end (SpecForge ``padding(x, left=False)``)."""
    if n == 0:
        return x
    pad = torch.zeros_like(x[:, :n])
    return torch.cat([x[:, n:], pad], dim=1)


def ttt_loss(draft: Eagle3Draft, batch: dict, target_head: torch.Tensor, length: int,
             decay: float = 0.8):
    """TTT loss of one batch.

    ``batch``: ``input_ids`` int64 [B, T], ``loss_mask`` [B, T] (0 on padding; the last valid
    position is also zeroed, as SpecForge's ``normalize_offline_sample`` does),
    ``aux_hidden_state`` [B, T, 3H], ``hidden_state`` [B, T, H] (post-norm), all on one device.
    ``target_head`` [V, H]: the target's lm_head (the tied embedding for the Llama targets).
    Returns ``(loss, metrics)`` with per-step accuracy (draft argmax == target argmax on masked
    rows) and per-step loss.
    """
    ids, mask = batch["input_ids"], batch["loss_mask"].float()
    aux, last = batch["aux_hidden_state"].float(), batch["hidden_state"].float()
    B, T = ids.shape
    with torch.no_grad():
        tlogits = _shift_left(last, 1) @ target_head.float().T  # [B, T, V]: logits at t+1
        t_arg = tlogits.argmax(-1)
        in_draft = draft.t2d[t_arg].float()
        tp = torch.softmax(tlogits[..., draft.t2d], dim=-1)  # target_p over the draft vocab
        pos_mask = in_draft * mask
        # pad `length` rows so step k can read rows t + k
        tp = torch.cat([tp, tp.new_zeros(B, length, tp.shape[-1])], dim=1)
        t_arg = torch.cat([t_arg, t_arg.new_zeros(B, length)], dim=1)
    ids = _shift_left(ids, 1)
    hidden = draft.aux_to_hidden(aux)
    pos = torch.arange(T, device=ids.device)
    causal = torch.full((T, T), float("-inf"), device=ids.device).triu(1)
    cache: list = []
    total, metrics = 0.0, {"acc": [], "loss": []}
    for k in range(length):
        emb = draft.embed(ids)
        hidden = draft.midlayer(emb, hidden, cache, pos + k, causal)
        logits = draft.lm_head(draft.norm(hidden)).float()
        logp = F.log_softmax(logits, dim=-1)
        tpk = tp[:, k:k + T]
        per_row = -(tpk * logp).sum(-1)
        denom = pos_mask.sum().clamp_min(1.0)
        lk = (per_row * pos_mask).sum() / denom
        total = total + (decay ** k) * lk
        with torch.no_grad():
            pred = logits.argmax(-1)
            pred_t = pred + draft.d2t[pred]
            valid = mask.sum().clamp_min(1.0)
            metrics["acc"].append(float(((pred_t == t_arg[:, k:k + T]).float() * mask).sum()
                                        / valid))
            metrics["loss"].append(float(lk))
        if k + 1 < length:
            ids = _shift_left(ids, 1)
            mask = _shift_left(mask, 1)
            pos_mask = _shift_left(pos_mask, 1)
    return total, metrics
