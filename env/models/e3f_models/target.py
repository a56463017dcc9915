"""Reference targets, one adapter per model family (``FAMILIES``), trained on the offline corpus.

``llama`` (the default; ``TARGET_SHAPE``): HF ``LlamaForCausalLM``, hidden 128, 8 decoder layers, 8
attention heads and 8 KV heads (head_dim 16; both divisible by 8 so SGLang TP 1/2/4/8 all shard
evenly), MLP 384, vocab 4096 with tied input/output embeddings, RoPE theta 10000, max 512 positions.
About 2.2 M parameters; saved in bf16 safetensors (~4.5 MB), served by SGLang with ``--dtype
float32``. (At equal CPU compute, ~23 min on 2 cores, this shape reached held-out ppl 48 vs 55 for
hidden 192 and 93 for hidden 256: the corpus and budget are small, so a narrower model trained on
more tokens is the better LM.) ``--num-heads 2 --num-kv-heads 2`` gives the head_dim-64 variant
(``llama_h64/``) for engines that refuse head_dim 16 (vLLM's CPU attention).

``kimi`` (``KIMI_SHAPE``): HF ``DeepseekV3ForCausalLM``, a Kimi-K2-class target: MLA (q_lora 64,
kv_lora 64, nope 16 + rope 8 per head, v 16, 8 heads), ``first_k_dense_replace`` 1 dense layer
then 7 MoE layers of 8 routed experts (top-2, sigmoid scores + ``e_score_correction_bias``,
``noaux_tc``, renormalised, x ``routed_scaling_factor`` 2.827) plus 1 shared expert, yarn RoPE
with factor 1 (= plain RoPE, interleaved), untied lm_head. The keys SGLang 0.5.23 reads that
transformers' ``DeepseekV3Config`` does not define are passed through: ``moe_layer_freq``
(sglang/srt/models/deepseek_v2.py::DeepseekV2DecoderLayer._is_layer_sparse), ``topk_method``
(deepseek_v2.py::MoEGate.__init__: only ``noaux_tc`` builds the correction bias), ``scoring_func``
(deepseek_v2.py::DeepseekV2MoE.__init__); RoPE must be yarn on CPU
(sglang/srt/layers/rotary_embedding/factory.py::get_rope_cpu asserts ``deepseek_yarn``, which
deepseek_v2.py::DeepseekV2AttentionMLA.__init__ sets for any non-default rope_parameters).
The correction bias is trained by DeepSeek-V3's auxiliary-loss-free balancing rule
(``ExpertBalancer``) and saved in fp32 like DeepSeek's checkpoints.

Everything downstream (self-distillation, hidden-state capture, draft training) loads the *saved*
bf16 weights upcast to fp32, so training data and serving see the same numbers.
"""
from __future__ import annotations

import math
import time
import torch

from .tok import BOS_ID, EOS_ID, PAD_ID

TARGET_SHAPE = dict(hidden_size=128, num_hidden_layers=8, num_attention_heads=8,
                    num_key_value_heads=8, intermediate_size=384, vocab_size=4096,
                    max_position_embeddings=512)

KIMI_SHAPE = dict(hidden_size=128, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=8, intermediate_size=384, vocab_size=4096,
                  max_position_embeddings=512,
                  q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=16, qk_rope_head_dim=8,
                  v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                  moe_intermediate_size=64, first_k_dense_replace=1, n_group=1, topk_group=1,
                  routed_scaling_factor=2.827, norm_topk_prob=True)
KIMI_ROPE_THETA = 50000.0  # Kimi-K2's


def target_config(**overrides):
    """``transformers.LlamaConfig`` of the reference target (``TARGET_SHAPE`` + overrides)."""
    from transformers import LlamaConfig

    kw = dict(TARGET_SHAPE)
    kw.update(overrides)
    return LlamaConfig(**kw, hidden_act="silu", rms_norm_eps=1e-5, rope_theta=10000.0,
                       tie_word_embeddings=True, attention_bias=False, mlp_bias=False,
                       bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
                       initializer_range=0.02)


def kimi_rope_parameters(max_position_embeddings: int, theta: float = KIMI_ROPE_THETA) -> dict:
    """Yarn ``rope_parameters`` with factor 1 (identical to plain RoPE on both sides).

    SGLang on CPU only builds ``DeepseekScalingRotaryEmbedding`` (factory.py::get_rope_cpu asserts
    ``rope_type == "deepseek_yarn"``); with ``factor`` 1 its interpolated and extrapolated
    frequencies coincide and ``yarn_get_mscale(1) == 1``, so neither the cos/sin cache
    (rope_variant.py::DeepseekScalingRotaryEmbedding) nor the softmax scale
    (configs/model_config.py::compute_mla_mscale_scaling) changes; transformers'
    ``_compute_yarn_parameters`` gives attention factor 1 and ``yarn_apply_mscale`` leaves the scale.
    ``original_max_position_embeddings == max_position_embeddings`` so the cos/sin cache covers
    exactly the positions served. The beta / mscale values are Kimi-K2's (inert at factor 1).
    """
    return {"rope_type": "yarn", "rope_theta": float(theta), "factor": 1.0,
            "original_max_position_embeddings": int(max_position_embeddings),
            "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}


def kimi_config(**overrides):
    """``transformers.DeepseekV3Config`` of the Kimi-class target (``KIMI_SHAPE`` + overrides),
    with SGLang's extra keys (``moe_layer_freq`` 1, ``topk_method`` ``noaux_tc``,
    ``scoring_func`` ``sigmoid``), yarn factor-1 RoPE, ``rope_interleave`` true and an untied
    lm_head (Kimi-K2's ``tie_word_embeddings`` is false)."""
    from transformers import DeepseekV3Config

    kw = dict(KIMI_SHAPE)
    kw.update(overrides)
    return DeepseekV3Config(**kw, hidden_act="silu", rms_norm_eps=1e-6,
                            rope_parameters=kimi_rope_parameters(kw["max_position_embeddings"]),
                            rope_interleave=True, tie_word_embeddings=False,
                            attention_bias=False, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
                            pad_token_id=PAD_ID, initializer_range=0.02,
                            moe_layer_freq=1, topk_method="noaux_tc", scoring_func="sigmoid")


class ExpertBalancer:
    """DeepSeek-V3's auxiliary-loss-free load balancing (arXiv 2412.19437, section 2.1.2).

    Forward hooks on every ``DeepseekV3TopkRouter`` (``mlp.gate``) count the experts each training
    token is routed to (the router's third output, ``topk_indices [N, top_k]``); after each
    optimiser step ``after_step`` moves each layer's ``e_score_correction_bias [E]`` (fp32) by
    ``-gamma * sign(load_e - mean load)``: overloaded experts get less, underloaded ones more. The
    bias only shifts which experts are chosen (the gate weights use the unbiased sigmoid scores),
    as in HF ``DeepseekV3TopkRouter.forward`` and SGLang's ``biased_grouped_topk``. Counts from
    eval forwards (``module.training`` false) are ignored.
    """

    def __init__(self, model, gamma: float = 1e-3):
        self.gamma = gamma
        self.gates = [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "gate")]
        self.counts = [torch.zeros(g.e_score_correction_bias.numel(), dtype=torch.float64)
                       for g in self.gates]
        self.total = [c.clone() for c in self.counts]
        self.handles = [g.register_forward_hook(self._hook(i)) for i, g in enumerate(self.gates)]

    def _hook(self, i):
        def hook(module, inputs, output):
            if module.training:
                idx = output[2].detach().reshape(-1)
                self.counts[i] += torch.bincount(idx, minlength=self.counts[i].numel()).cpu()
        return hook

    @torch.no_grad()
    def after_step(self) -> None:
        for g, c, t in zip(self.gates, self.counts, self.total):
            if c.sum() > 0:
                err = (c - c.mean()).sign().to(g.e_score_correction_bias)
                g.e_score_correction_bias.sub_(self.gamma * err)
                t += c
                c.zero_()

    def stats(self) -> dict:
        """Per MoE layer: share of routed tokens per expert over training, and the final bias."""
        return {"gamma": self.gamma,
                "layers": [{"load_share": [round(float(x), 4) for x in t / t.sum().clamp_min(1)],
                            "e_score_correction_bias": [round(float(x), 4) for x in
                                                        g.e_score_correction_bias.float().cpu()]}
                           for g, t in zip(self.gates, self.total)]}

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


class TargetFamily:
    """One target model family behind one seam: HF class, config, training hook, save rule and
    the shape of a Llama-style draft for it. Subclasses: ``LlamaFamily``, ``KimiFamily``.

    ``name``: CLI name (``train_target.py --family``); ``model_type``: config.json's;
    ``shape_keys``: the config keys the training log records.
    """
    name = ""
    model_type = ""
    shape_keys: tuple = ("hidden_size", "num_hidden_layers", "num_attention_heads",
                         "num_key_value_heads", "intermediate_size", "vocab_size",
                         "max_position_embeddings", "tie_word_embeddings")

    def config(self, **overrides):
        """The HF config object of the reference shape with ``overrides``."""
        raise NotImplementedError

    def new_model(self, cfg):
        """A freshly initialised HF model (on CPU; seed torch first)."""
        raise NotImplementedError

    def describe(self, cfg, n_params: int) -> str:
        """One line for the training log."""
        raise NotImplementedError

    def balancer(self, model):
        """The per-step training hook (``after_step()``, ``stats()``, ``remove()``) or None."""
        return None

    def save(self, model, out) -> None:
        """``save_pretrained`` in bf16."""
        model.to(torch.bfloat16).save_pretrained(out)

    def draft_attention(self, tcfg: dict) -> tuple[int, int, int]:
        """``(num_attention_heads, num_key_value_heads, head_dim)`` of a Llama-style draft."""
        raise NotImplementedError

    def draft_shape(self, tcfg: dict) -> dict:
        """Shape keys of a Llama-style (``LlamaForCausalLMEagle3``) draft for the target whose
        config.json dict is ``tcfg``: one decoder layer of the target's width, MLP = the target's
        (dense) ``intermediate_size``, plain RoPE at the target's theta, the target's norm eps
        and max positions; attention from ``draft_attention``."""
        nh, nkv, hd = self.draft_attention(tcfg)
        rope = (tcfg.get("rope_parameters") or {}).get("rope_theta",
                                                      tcfg.get("rope_theta", 10000.0))
        return {"hidden_size": tcfg["hidden_size"], "intermediate_size": tcfg["intermediate_size"],
                "num_attention_heads": nh, "num_key_value_heads": nkv, "head_dim": hd,
                "hidden_act": tcfg.get("hidden_act", "silu"),
                "max_position_embeddings": tcfg["max_position_embeddings"],
                "rms_norm_eps": tcfg["rms_norm_eps"], "rope_theta": rope}


class LlamaFamily(TargetFamily):
    """HF ``LlamaForCausalLM`` (``target_config``)."""
    name, model_type = "llama", "llama"

    def config(self, **overrides):
        return target_config(**overrides)

    def new_model(self, cfg):
        from transformers import LlamaForCausalLM
        return LlamaForCausalLM(cfg)

    def describe(self, cfg, n_params: int) -> str:
        return (f"Llama: hidden {cfg.hidden_size}, {cfg.num_hidden_layers} layers, "
                f"{cfg.num_attention_heads} heads / {cfg.num_key_value_heads} KV heads, MLP "
                f"{cfg.intermediate_size}, vocab {cfg.vocab_size} (tied): "
                f"{n_params / 1e6:.2f} M params")

    def draft_attention(self, tcfg: dict) -> tuple[int, int, int]:
        """The target's own heads, KV heads and head_dim."""
        h, nh = tcfg["hidden_size"], tcfg["num_attention_heads"]
        return nh, tcfg["num_key_value_heads"], tcfg.get("head_dim") or h // nh


class KimiFamily(TargetFamily):
    """HF ``DeepseekV3ForCausalLM`` (``kimi_config``), trained with ``ExpertBalancer``."""
    name, model_type = "kimi", "deepseek_v3"
    shape_keys = TargetFamily.shape_keys + (
        "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
        "n_routed_experts", "num_experts_per_tok", "n_shared_experts", "moe_intermediate_size",
        "first_k_dense_replace", "moe_layer_freq", "n_group", "topk_group", "topk_method",
        "scoring_func", "routed_scaling_factor", "norm_topk_prob", "rope_interleave",
        "rope_parameters")

    def config(self, **overrides):
        return kimi_config(**overrides)

    def new_model(self, cfg):
        from transformers import DeepseekV3ForCausalLM
        return DeepseekV3ForCausalLM(cfg)

    def describe(self, cfg, n_params: int) -> str:
        return (f"DeepseekV3 (Kimi-class): hidden {cfg.hidden_size}, {cfg.num_hidden_layers} "
                f"layers ({cfg.first_k_dense_replace} dense), MLA {cfg.num_attention_heads} heads "
                f"q_lora {cfg.q_lora_rank} kv_lora {cfg.kv_lora_rank} nope {cfg.qk_nope_head_dim} "
                f"rope {cfg.qk_rope_head_dim} v {cfg.v_head_dim}, {cfg.n_routed_experts} routed "
                f"experts top-{cfg.num_experts_per_tok} + {cfg.n_shared_experts} shared (moe "
                f"{cfg.moe_intermediate_size}), vocab {cfg.vocab_size} (untied): "
                f"{n_params / 1e6:.2f} M params")

    def balancer(self, model):
        return ExpertBalancer(model)

    def save(self, model, out) -> None:
        """bf16, except ``e_score_correction_bias`` kept fp32 (as DeepSeek's checkpoints store it
        and HF's ``_keep_in_fp32_modules_strict`` / SGLang's ``MoEGate`` hold it)."""
        keep = {n: b.detach().float().clone() for n, b in model.named_buffers()
                if n.endswith("e_score_correction_bias")}
        model.to(torch.bfloat16)
        for n, b in model.named_buffers():
            if n in keep:
                b.data = keep[n].to(b.device)
        model.save_pretrained(out)

    def draft_attention(self, tcfg: dict) -> tuple[int, int, int]:
        """MHA with the target's head count at ``hidden // heads`` (the MLA dims are not a Llama
        layer's); what SpecForge / TorchSpec train for Kimi-K2.5 is such a draft
        (``LlamaForCausalLMEagle3``, hidden 7168, 64 x 128 heads, 64 KV heads, no rope scaling)."""
        h, nh = tcfg["hidden_size"], tcfg["num_attention_heads"]
        return nh, nh, h // nh


FAMILIES = {f.name: f for f in (LlamaFamily(), KimiFamily())}


def family_of(tcfg: dict) -> TargetFamily:
    """The family of a target config.json dict (by ``model_type``); ValueError when unknown."""
    for f in FAMILIES.values():
        if f.model_type == tcfg.get("model_type"):
            return f
    raise ValueError(f"config.json: model_type {tcfg.get('model_type')!r} is not a reference "
                     f"target family (expected one of {[f.model_type for f in FAMILIES.values()]})")


def load_target(path, dtype=torch.float32):
    """Load a saved target with HF transformers, in ``dtype`` (fp32 by default), eval mode."""
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    m.eval()
    return m


def pack_documents(token_lists: list[list[int]], seq_len: int) -> torch.Tensor:
    """Concatenate ``<s> doc </s>`` streams and cut into ``[N, seq_len]`` int64 rows (tail dropped).

    ``token_lists`` must already start with ``<s>`` (the tokenizer's post-processor adds it).
    """
    flat: list[int] = []
    for ids in token_lists:
        flat.extend(ids)
        flat.append(EOS_ID)
    n = len(flat) // seq_len
    return torch.tensor(flat[: n * seq_len], dtype=torch.long).view(n, seq_len)


@torch.no_grad()
def eval_loss(model, rows: torch.Tensor, batch_size: int = 32) -> float:
    """Mean next-token cross-entropy (nats/token) of ``model`` over ``rows [N, T]``."""
    model.eval()
    tot, cnt = 0.0, 0
    dev = next(model.parameters()).device
    for i in range(0, len(rows), batch_size):
        x = rows[i:i + batch_size].to(dev)
        logits = model(input_ids=x).logits[:, :-1].float()
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                 x[:, 1:].reshape(-1), reduction="sum")
        tot += loss.item()
        cnt += x[:, 1:].numel()
    return tot / max(cnt, 1)


def train_target(model, rows: torch.Tensor, *, steps: int, batch_size: int, lr: float,
                 min_lr: float, warmup: int, weight_decay: float, seed: int,
                 heldout_rows: torch.Tensor | None = None, eval_every: int = 100,
                 log=print, after_step=None) -> list[dict]:
    """AdamW + linear warmup + cosine decay on shuffled ``rows``; returns a list of log records.

    Runs on the model's device. Deterministic for a fixed seed, device, thread count and torch
    build (the data order comes from a seeded CPU ``torch.Generator``). ``after_step``: called
    with no argument after every optimiser step (the family's training hook, e.g.
    ``ExpertBalancer.after_step``).
    """
    from tqdm import tqdm

    g = torch.Generator().manual_seed(seed)
    dev = next(model.parameters()).device
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95), eps=1e-8)

    def lr_at(s):
        if s < warmup:
            return lr * (s + 1) / warmup
        t = (s - warmup) / max(1, steps - warmup)
        return min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * t))

    order = torch.randperm(len(rows), generator=g)
    pos = 0
    records = []
    t0 = time.time()
    ema = None
    bar = tqdm(range(steps), desc="target train", mininterval=5)
    for s in bar:
        model.train()
        if pos + batch_size > len(order):
            order = torch.randperm(len(rows), generator=g)
            pos = 0
        x = rows[order[pos:pos + batch_size]].to(dev)
        pos += batch_size
        for grp in opt.param_groups:
            grp["lr"] = lr_at(s)
        out = model(input_ids=x, labels=x)
        out.loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if after_step is not None:
            after_step()
        li = out.loss.item()
        ema = li if ema is None else 0.95 * ema + 0.05 * li
        bar.set_postfix(loss=f"{ema:.3f}", lr=f"{lr_at(s):.2e}")
        rec = {"step": s + 1, "loss": li, "grad_norm": float(gn), "lr": lr_at(s),
               "tokens": (s + 1) * x.numel(), "elapsed_s": time.time() - t0}
        if heldout_rows is not None and ((s + 1) % eval_every == 0 or s + 1 == steps):
            rec["heldout_loss"] = eval_loss(model, heldout_rows)
            log(f"step {s + 1}/{steps}: train loss (ema) {ema:.3f}, held-out loss "
                f"{rec['heldout_loss']:.3f} (ppl {math.exp(rec['heldout_loss']):.1f}), "
                f"{rec['tokens'] / rec['elapsed_s']:.0f} tok/s")
        records.append(rec)
    return records


@torch.no_grad()
def greedy_continue(model, prompts: list[list[int]], max_new_tokens: int,
                    batch_size: int = 64, stop_at_eos: bool = True, progress: bool = False,
                    temperature: float = 0.0, seed: int = 0):
    """Greedy (argmax) continuations of token-id prompts with a KV cache (HF transformers).

    Prompts are grouped by length so no padding is ever needed. No logit is masked (unlike HF
    ``generate(min_new_tokens=...)``), so this is the same argmax rule as SGLang at temperature 0.
    Returns a list of generated id lists (without the prompt), truncated after the first ``</s>``
    when ``stop_at_eos`` (what SGLang does by default). ``temperature > 0`` samples instead
    (seeded ``torch.Generator`` on the model's device; used for draft-data diversity only).
    """
    from tqdm import tqdm

    model.eval()
    dev = next(model.parameters()).device
    out: list[list[int] | None] = [None] * len(prompts)
    by_len: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        by_len.setdefault(len(p), []).append(i)
    batches = []
    for L in sorted(by_len):
        idx = by_len[L]
        for j in range(0, len(idx), batch_size):
            batches.append(idx[j:j + batch_size])
    rng = torch.Generator(device=dev).manual_seed(seed)

    def pick(logits):
        if temperature <= 0:
            return logits.float().argmax(-1)
        probs = torch.softmax(logits.float() / temperature, dim=-1)
        return torch.multinomial(probs, 1, generator=rng)[:, 0]

    for b in tqdm(batches, desc="greedy" if temperature <= 0 else "sample", disable=not progress):
        x = torch.tensor([prompts[i] for i in b], dtype=torch.long, device=dev)
        res = model(input_ids=x, use_cache=True)
        past = res.past_key_values
        nxt = pick(res.logits[:, -1])
        gen_t = [nxt]
        for _ in range(max_new_tokens - 1):
            res = model(input_ids=nxt[:, None], past_key_values=past, use_cache=True)
            past = res.past_key_values
            nxt = pick(res.logits[:, -1])
            gen_t.append(nxt)
        gen = torch.stack(gen_t, 1).tolist()
        for i, g in zip(b, gen):
            if stop_at_eos and EOS_ID in g:
                g = g[: g.index(EOS_ID) + 1]
            out[i] = g
    return out


def distinct_n(seqs: list[list[int]], n: int = 4) -> dict:
    """Distinct-n of token sequences: ``pooled`` = unique / total n-grams over all sequences,
    ``mean`` = mean per-sequence ratio (sequences shorter than n are skipped)."""
    per, allg, tot = [], set(), 0
    for s in seqs:
        grams = [tuple(s[i:i + n]) for i in range(len(s) - n + 1)]
        if not grams:
            continue
        per.append(len(set(grams)) / len(grams))
        allg.update(grams)
        tot += len(grams)
    return {"pooled": len(allg) / max(tot, 1), "mean": sum(per) / max(len(per), 1),
            "n": n, "sequences": len(per)}
