"""NextN / MTP head of the Kimi-class (DeepSeek-V3) target, as SGLang serves it, and its trainer loss.

Mirrors SGLang 0.5.23 ``sglang/srt/models/deepseek_nextn.py::DeepseekModelNextN.forward`` (CPU path, the
``torch.cat`` branch; the CUDA ``fused_eh_norm`` computes the same):

    e   = embed_tokens(token t+1)                                  [.., H]   the target's embedding
    h   = the target's last hidden state at t, AFTER its final norm [.., H]   (``spec_info.hidden_states``:
          ``deepseek_v2.py::DeepseekV2Model.forward`` returns ``final_norm(hidden, self.norm)`` and passes no
          ``hidden_states_before_norm`` to ``LogitsProcessor``, so ``_get_hidden_states_to_store`` keeps the
          post-norm state)
    x   = eh_proj(cat(enorm(e), hnorm(h)))                          [.., 2H] -> [.., H]  (embedding half first)
    y   = decoder(x)      one ``DeepseekV2DecoderLayer(is_nextn=True)``: MLA + MoE (``_is_layer_sparse`` is
                          true for NextN), rotary position of token t (the row's own position)
    out = shared_head.norm(y)                                       the next draft step's ``h``
    logits = out @ shared_head.head^T  (SGLang: the target's lm_head, ``set_embed_and_head``)

The same order (``cat(enorm(embeds), hnorm(previous_hidden))``) is HF transformers 5.19's
``modeling_layers.py::MtpLayer.forward`` (unless ``mtp_hidden_states_first``) and vLLM 0.32's
``deepseek_mtp.py::DeepSeekMultiTokenPredictorLayer.forward`` (which also zeroes the embedding at position 0).

The decoder is transformers' own ``DeepseekV3DecoderLayer(config, layer_idx=num_hidden_layers)`` (the
target's layer class, MoE since ``num_hidden_layers >= first_k_dense_replace``), so its math is the
target's. Checkpoint names (``nextn_state_dict``) are DeepSeek-V3's extra layer ``model.layers.{N}.*``
with N = ``num_hidden_layers``: ``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm``,
``shared_head.head``, ``embed_tokens`` and the decoder's per-expert names, which SGLang's
``deepseek_common/deepseek_weight_loader.py::do_load_weights`` (``NextNEnabledConfig``) maps to ``model.*``
(the four ``nextn_spec_weight_names``) and ``model.decoder.*`` (the rest), skipping ``embed_tokens`` and
``shared_head.head`` (the target's are shared).
"""
from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

# the NextN-only names of SGLang's NextNEnabledConfig.nextn_spec_weight_names (deepseek_weight_loader.py)
SPEC_WEIGHT_NAMES = ("shared_head.norm", "eh_proj", "enorm", "hnorm")
SHARED_NAMES = ("embed_tokens.weight", "shared_head.head.weight")


def _hf_config(target_cfg):
    """A transformers ``DeepseekV3Config`` from a config.json dict (or a config), SDPA attention."""
    from transformers import DeepseekV3Config
    cfg = copy.deepcopy(target_cfg) if not isinstance(target_cfg, dict) else DeepseekV3Config(**target_cfg)
    cfg._attn_implementation = "sdpa"
    cfg._experts_implementation = "eager"  # DeepseekV3Experts' per-expert loop (as the target runs it)
    return cfg


class NextNHead(nn.Module):
    """The NextN head (see the module docstring). ``target_cfg``: the target's config.json dict;
    ``embed_weight`` / ``head_weight`` [V, H]: the target's embedding and lm_head (frozen, shared)."""

    architecture = "DeepseekV3ForCausalLMNextN"

    def __init__(self, target_cfg, embed_weight: torch.Tensor, head_weight: torch.Tensor):
        super().__init__()
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import (DeepseekV3DecoderLayer,
                                                                          DeepseekV3RMSNorm,
                                                                          DeepseekV3RotaryEmbedding)
        cfg = _hf_config(target_cfg)
        self.cfg = cfg
        self.layer_id = cfg.num_hidden_layers
        H, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.embed_tokens = nn.Embedding.from_pretrained(embed_weight.float().clone(), freeze=True)
        self.enorm = DeepseekV3RMSNorm(H, eps)
        self.hnorm = DeepseekV3RMSNorm(H, eps)
        self.eh_proj = nn.Linear(2 * H, H, bias=False)
        self.decoder = DeepseekV3DecoderLayer(cfg, layer_idx=self.layer_id)
        self.shared_head = nn.Module()
        self.shared_head.norm = DeepseekV3RMSNorm(H, eps)
        self.shared_head.head = nn.Linear(H, cfg.vocab_size, bias=False)
        with torch.no_grad():
            self.shared_head.head.weight.copy_(head_weight.float())
        self.shared_head.head.weight.requires_grad_(False)
        self.rotary = DeepseekV3RotaryEmbedding(cfg)

    def init_from_target(self, target_layer: nn.Module, seed: int, std: float = 0.02) -> None:
        """Start the decoder from a copy of the target's decoder layer ``target_layer`` (its last, a
        MoE layer of the same class), ``eh_proj`` ~ Normal(0, std) (seeded), norms ones."""
        self.decoder.load_state_dict(target_layer.state_dict())
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            self.eh_proj.weight.copy_(torch.randn(self.eh_proj.weight.shape, generator=g) * std)

    def step(self, next_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
             mask: torch.Tensor) -> torch.Tensor:
        """One head forward. ``next_ids`` int64 [B, T] (token t+1), ``hidden`` fp32 [B, T, H] (the
        target's post-norm state at t, or this head's previous output), ``positions`` int64 [B, T],
        ``mask`` additive fp32 [B or 1, 1, T, S] over the keys of ``hidden``'s rows (S = T for one step).
        Returns the output after ``shared_head.norm`` [B, T, H] (``DeepseekModelNextN.forward``)."""
        e = self.embed_tokens(next_ids)
        x = self.eh_proj(torch.cat([self.enorm(e), self.hnorm(hidden)], dim=-1))
        cos_sin = self.rotary(x, positions)
        y = self.decoder(x, attention_mask=mask, position_ids=positions, position_embeddings=cos_sin)
        return self.shared_head.norm(y)

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """``out @ shared_head.head^T`` [.., V] fp32."""
        return self.shared_head.head(out).float()


def causal_mask(T: int, device) -> torch.Tensor:
    """Additive causal mask [1, 1, T, T] (0 on and below the diagonal, -inf above)."""
    return torch.full((T, T), float("-inf"), device=device).triu(1)[None, None]


def chain_mask(T: int, k: int, device) -> torch.Tensor:
    """Additive mask [1, 1, (k+1)T, (k+1)T] of a (k+1)-step chain laid out step by step: row t of step j
    sees rows s <= t of step 0 and row t of steps 1..j (SpecForge's TTT mask; SGLang's draft decode reads
    the draft KV of the prefix plus the chain's own earlier tokens)."""
    n = (k + 1) * T
    m = torch.full((n, n), float("-inf"), device=device)
    m[:, :T] = causal_mask(T, device)[0, 0].repeat(k + 1, 1)
    eye = torch.where(torch.eye(T, device=device, dtype=torch.bool), 0.0, float("-inf"))
    for j in range(1, k + 1):
        for i in range(1, j + 1):
            m[j * T:(j + 1) * T, i * T:(i + 1) * T] = eye
    return m[None, None]


def _shift_left(x: torch.Tensor, n: int = 1) -> torch.Tensor:
    if n == 0:
        return x
    return torch.cat([x[:, n:], torch.zeros_like(x[:, :n])], dim=1)


def nextn_loss(head: NextNHead, batch: dict, target_head: torch.Tensor, steps: int = 1,
               train_steps: int = 1, decay: float = 0.8):
    """Loss and per-step accuracy of the head on one batch.

    ``batch``: ``input_ids`` int64 [B, T], ``loss_mask`` [B, T] (0 on padding and on the last valid row),
    ``hidden_state`` [B, T, H] (the target's post-norm last hidden state, SpecForge's ``hidden_state``).
    ``target_head`` [V, H]: the target's lm_head. Row t of step 0 pairs token t+1 with the target's state at
    t (position t) and is scored against the target's distribution at t+1, i.e. for token t+2. Step k >= 1
    (evaluation of a chain, as SGLang's draft decode runs it with ``--speculative-num-steps`` > 1) feeds the
    step k-1 output back at the same row with token t+k+1 at position t+k, scored for token t+k+2.
    Loss: soft cross-entropy over the full vocabulary on rows with loss mask 1, steps < ``train_steps``
    weighted ``decay**k``. Returns ``(loss, {"acc": [steps], "loss": [steps]})``; accuracy = head argmax ==
    target argmax on masked rows.
    """
    ids, mask = batch["input_ids"], batch["loss_mask"].float()
    last = batch["hidden_state"].float()
    B, T = ids.shape
    dev = ids.device
    with torch.no_grad():
        tlogits = _shift_left(last, 1) @ target_head.float().T  # [B, T, V]: the target at t+1
        t_arg = torch.cat([tlogits.argmax(-1), tlogits.new_zeros(B, steps, dtype=torch.long)], 1)
        tp = torch.softmax(tlogits, dim=-1)
        tp = torch.cat([tp, tp.new_zeros(B, steps, tp.shape[-1])], dim=1)
    pos = torch.arange(T, device=dev)[None].expand(B, T)
    xs_ids, xs_h, xs_pos = [], [], []
    ids_k, hidden = _shift_left(ids, 1), last
    total, metrics = 0.0, {"acc": [], "loss": []}
    for k in range(steps):
        xs_ids.append(ids_k)
        xs_h.append(hidden)
        xs_pos.append(pos + k)
        if k == 0:
            out = head.step(ids_k, hidden, pos, causal_mask(T, dev))
        else:  # the whole chain so far, step by step, under the chain mask; keep the last step's rows
            out = head.step(torch.cat(xs_ids, 1), torch.cat(xs_h, 1), torch.cat(xs_pos, 1),
                            chain_mask(T, k, dev))[:, k * T:]
        logits = head.logits(out)
        logp = F.log_softmax(logits, dim=-1)
        per_row = -(tp[:, k:k + T] * logp).sum(-1)
        lk = (per_row * mask).sum() / mask.sum().clamp_min(1.0)
        if k < train_steps:
            total = total + (decay ** k) * lk
        with torch.no_grad():
            hit = (logits.argmax(-1) == t_arg[:, k:k + T]).float()
            metrics["acc"].append(float((hit * mask).sum() / mask.sum().clamp_min(1.0)))
            metrics["loss"].append(float(lk))
        if k + 1 < steps:
            hidden = out if k + 1 < train_steps else out.detach()
            ids_k = _shift_left(ids_k, 1)
            mask = _shift_left(mask, 1)
    return total, metrics


# ---- checkpoint names -------------------------------------------------------------------------------

def nextn_state_dict(head: NextNHead, dtype=torch.bfloat16) -> dict:
    """The head's tensors under DeepSeek-V3's checkpoint names ``model.layers.{N}.*`` (N =
    ``num_hidden_layers``), experts per expert (``mlp.experts.{e}.{gate,up,down}_proj.weight``, as HF's
    ``save_pretrained`` writes the target's), ``e_score_correction_bias`` fp32, the rest ``dtype``;
    ``embed_tokens`` and ``shared_head.head`` included (copies of the target's, as DeepSeek-V3 ships them)."""
    p = f"model.layers.{head.layer_id}."
    out = {}
    for k, v in head.decoder.state_dict().items():
        v = v.detach().cpu()
        if k == "mlp.experts.gate_up_proj":  # [E, 2I, H]: gate rows first (DeepseekV3Experts.forward chunk)
            inter = v.shape[1] // 2
            for e in range(v.shape[0]):
                out[f"{p}mlp.experts.{e}.gate_proj.weight"] = v[e, :inter].to(dtype).contiguous()
                out[f"{p}mlp.experts.{e}.up_proj.weight"] = v[e, inter:].to(dtype).contiguous()
        elif k == "mlp.experts.down_proj":  # [E, H, I]
            for e in range(v.shape[0]):
                out[f"{p}mlp.experts.{e}.down_proj.weight"] = v[e].to(dtype).contiguous()
        elif k.endswith("e_score_correction_bias"):
            out[p + k] = v.float().clone()
        else:
            out[p + k] = v.to(dtype).contiguous()
    for name, mod in (("enorm", head.enorm), ("hnorm", head.hnorm), ("eh_proj", head.eh_proj),
                      ("shared_head.norm", head.shared_head.norm),
                      ("shared_head.head", head.shared_head.head), ("embed_tokens", head.embed_tokens)):
        out[f"{p}{name}.weight"] = mod.weight.detach().cpu().to(dtype).contiguous()
    return out


def load_nextn_state_dict(head: NextNHead, w: dict) -> None:
    """Load ``model.layers.{N}.*`` tensors of a checkpoint dict (other keys ignored) into ``head`` (fp32),
    strictly: ValueError naming the missing / unexpected NextN keys. ``embed_tokens`` / ``shared_head.head``
    are optional (SGLang shares the target's); when present they must equal the head's shared tensors'
    shape."""
    p = f"model.layers.{head.layer_id}."
    mine = {k[len(p):]: v for k, v in w.items() if k.startswith(p)}
    want = set(k[len(p):] for k in nextn_state_dict(head, torch.float32))
    optional = set(SHARED_NAMES)
    missing = sorted(want - optional - set(mine))
    unexpected = sorted(set(mine) - want)
    if missing or unexpected:
        raise ValueError(f"NextN checkpoint ({p}*): missing {missing}, unexpected {unexpected}")
    E = head.cfg.n_routed_experts
    dec = {}
    for k in head.decoder.state_dict():
        if k == "mlp.experts.gate_up_proj":
            dec[k] = torch.stack([torch.cat([mine[f"mlp.experts.{e}.gate_proj.weight"],
                                             mine[f"mlp.experts.{e}.up_proj.weight"]]) for e in range(E)])
        elif k == "mlp.experts.down_proj":
            dec[k] = torch.stack([mine[f"mlp.experts.{e}.down_proj.weight"] for e in range(E)])
        else:
            dec[k] = mine[k]
    head.decoder.load_state_dict({k: v.float() for k, v in dec.items()})
    with torch.no_grad():
        for name, mod in (("enorm", head.enorm), ("hnorm", head.hnorm), ("eh_proj", head.eh_proj),
                          ("shared_head.norm", head.shared_head.norm)):
            mod.weight.copy_(mine[f"{name}.weight"].float())


def load_nextn(target_dir) -> NextNHead:
    """The head stored in a target folder's model.safetensors (``model.layers.{num_hidden_layers}.*``),
    fp32, eval mode, with the target's embedding and lm_head. ValueError when the layer is absent."""
    import json
    from pathlib import Path

    from safetensors.torch import load_file
    target_dir = Path(target_dir)
    cfg = json.loads((target_dir / "config.json").read_text())
    w = load_file(str(target_dir / "model.safetensors"))
    emb = w["model.embed_tokens.weight"].float()
    head = NextNHead(cfg, emb, w.get("lm_head.weight", emb).float())
    load_nextn_state_dict(head, w)
    head.eval()
    return head
