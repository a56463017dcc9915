"""Run an EAGLE-3 draft's extend pass with SGLang 0.5.23's own modules, in the SGLang reference venv.

Usage (env/reference/.venv/bin/python, SGLANG_USE_CPU_ENGINE=1): sglang_eagle3_forward.py JOBS.json, a list of
``[DRAFT_DIR, INPUTS.pt, OUT.pt, DTYPE]`` (one process for all: importing sglang takes seconds).

INPUTS.pt holds ``embeds [T, H]`` (the embedding rows, already looked up), ``aux [T, W]`` and ``positions [T]``;
OUT.pt gets ``logits [T, V_draft]`` float32 and ``hidden [T, H]``. The control flow is a transcription of
``sglang/srt/models/llama_eagle3.py::LlamaModel.forward`` and ``LlamaDecoderLayer.forward``; the norms are SGLang's
``RMSNorm.forward_native`` (fused residual add included), the rotary embedding SGLang's ``get_rope``
(``forward_native`` on float32 q / k with the float32 cos/sin cache, the math of the CUDA kernel
``apply_rope_with_cos_sin_cache_inplace`` that GPU servers run; the native path would round cos/sin to the compute
dtype), the MLP activation ``SiluAndMul.forward_native``; attention is causal ``scaled_dot_product_attention`` (the
extend pass of one sequence; float32 softmax inside, as the serving backends). Weights are renamed as
``LlamaForCausalLMEagle3.load_weights`` renames them.
An independent check of helpers/draft/model.py, which is not imported here."""
import json
import sys

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from sglang.srt.layers.activation import SiluAndMul
from sglang.srt.layers.layernorm import RMSNorm
from sglang.srt.layers.rotary_embedding import get_rope

LEGACY = {"midlayer": "layers.0", "aux_norm_low": "fc_norm.0", "aux_norm_mid": "fc_norm.1",
          "aux_norm_high": "fc_norm.2"}


def main(draft_dir, inputs, out, dtype_name):
    dtype = getattr(torch, dtype_name)
    cfg = json.load(open(f"{draft_dir}/config.json"))
    w = {}
    for name, t in load_file(f"{draft_dir}/model.safetensors").items():
        for legacy, new in LEGACY.items():
            name = name.replace(legacy, new)
        w[name.removeprefix("model.")] = t
    eps, H = cfg["rms_norm_eps"], cfg["hidden_size"]
    nh, nkv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    hd = cfg.get("head_dim", H // nh)
    ec = cfg.get("eagle_config") or {}
    naux = cfg.get("num_aux_hidden_states") or len(ec.get("eagle_aux_hidden_state_layer_ids") or [0, 0, 0])

    def norm(name, size):
        n = RMSNorm(size, eps=eps).to(dtype)
        n.weight.data.copy_(w[name + ".weight"].to(dtype))
        return n.forward_native

    rope_cfg = cfg.get("rope_parameters") or cfg.get("rope_scaling")
    if rope_cfg and (rope_cfg.get("rope_type") or rope_cfg.get("type")) == "default":
        rope_cfg = None
    theta = cfg.get("rope_theta") or (rope_cfg or {}).get("rope_theta") or 10000.0
    rope = get_rope(hd, hd, cfg.get("max_position_embeddings", 8192), theta, True, rope_cfg, torch.float32)
    x = torch.load(inputs, weights_only=True)
    embeds, hidden, pos = x["embeds"].to(dtype), x["aux"].to(dtype), x["positions"]
    T = embeds.shape[0]
    # LlamaModel.forward, l. 238-247
    if hidden.shape[-1] != embeds.shape[-1]:
        if bool(ec.get("norm_before_fc", cfg.get("norm_before_fc", False))):
            hidden = norm("input_norm", hidden.shape[-1])(hidden)
        if cfg.get("fc_norm") or cfg.get("use_aux_norm", False):
            hidden = torch.cat([norm(f"fc_norm.{i}", c.shape[-1])(c) for i, c in enumerate(hidden.chunk(naux, -1))],
                               dim=-1)
        hidden = F.linear(hidden, w["fc.weight"].to(dtype), w["fc.bias"].to(dtype) if "fc.bias" in w else None)
    residual = None
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        # LlamaDecoderLayer.forward, l. 97-105
        if i == 0:
            residual = hidden
            hidden = torch.cat([norm(p + "input_layernorm", H)(embeds), norm(p + "hidden_norm", H)(hidden)], dim=-1)
        else:
            hidden, residual = norm(p + "hidden_norm", H)(hidden, residual)
        a = p + "self_attn."
        q = F.linear(hidden, w[a + "q_proj.weight"].to(dtype))
        k = F.linear(hidden, w[a + "k_proj.weight"].to(dtype))
        v = F.linear(hidden, w[a + "v_proj.weight"].to(dtype))
        q, k = (t.to(dtype) for t in rope.forward_native(pos, q.float(), k.float()))
        q, k, v = (t.view(T, -1, hd).transpose(0, 1) for t in (q, k, v))
        k, v = k.repeat_interleave(nh // nkv, 0), v.repeat_interleave(nh // nkv, 0)
        o = F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True, scale=hd ** -0.5)[0]
        o = o.transpose(0, 1).reshape(T, -1)
        hidden = F.linear(o, w[a + "o_proj.weight"].to(dtype))
        hidden, residual = norm(p + "post_attention_layernorm", H)(hidden, residual)     # l. 114
        gu = torch.cat([F.linear(hidden, w[p + "mlp.gate_proj.weight"].to(dtype)),
                        F.linear(hidden, w[p + "mlp.up_proj.weight"].to(dtype))], dim=-1)
        hidden = F.linear(SiluAndMul().forward_native(gu), w[p + "mlp.down_proj.weight"].to(dtype))
    to_logits, to_aux = norm("norm", H)(hidden, residual)                                  # l. 263-268
    aux = to_logits if cfg.get("norm_output", False) else to_aux
    head = w["lm_head.weight"].to(dtype)
    torch.save({"logits": F.linear(to_logits, head).float(), "hidden": aux}, out)


if __name__ == "__main__":
    for job in json.load(open(sys.argv[1])):
        main(*job)
