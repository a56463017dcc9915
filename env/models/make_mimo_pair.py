#!/usr/bin/env python
"""Build a Llama-class MTP pair that vLLM 0.32.0's CPU backend serves: the ``llama_h64`` target written as a MiMo
(``MiMoForCausalLM``, Qwen2-class) checkpoint with one MTP layer, ``model.mtp_layers.0.*``.

    python env/models/make_mimo_pair.py OUT      # -> OUT/config.json, OUT/model.safetensors, tokenizer files

Why MiMo: the Kimi-class target's MLA has a latent width of ``kv_lora_rank + qk_rope_head_dim`` = 72 and both of
vLLM 0.32.0's CPU MLA backends take 576 only (``vllm/v1/attention/backends/mla/cpu_mla.py::CPUMLABackend.
get_supported_head_sizes``, ``amx_mla.py::AMXMLABackend.get_supported_head_sizes``), so ``deepseek_mtp`` cannot run
on CPU here (docs/mtp.md). MiMo's target is Qwen2 (``vllm/model_executor/models/mimo.py::MiMoForCausalLM``) with
standard attention at head_dim 64, which vLLM's CPU attention serves; its MTP head is ``mimo_mtp.py::MiMoMTP``.

The target is unchanged in function: Qwen2's attention is Llama's plus q/k/v biases, written here as zeros.

The MTP layer is the trained EAGLE-1 draft ``llama_h64/draft_eagle1`` re-expressed in MiMo's form (it is not
trained as an MTP head; the figures test the engine's wiring, not a good head). vLLM's MiMo layer
(``mimo_mtp.py::MiMoMultiTokenPredictorLayer.forward``)::

    x   = input_proj(cat(hidden_layernorm(h_t), token_layernorm(embed(x_{t+1}))))   hidden half first
    y   = Qwen2DecoderLayer(x)         with its input_layernorm
    out = final_layernorm(y + residual)                                 logits = lm_head(out)

with ``h_t`` the target's state **before** its final norm (``mimo.py::MiMoModel.forward`` returns
``hidden_states + residual``; ``MiMoForCausalLM.compute_logits`` applies ``model.norm``). The EAGLE-1 draft computes
``fc(cat(embed(x_{t+1}), post_norm(h_t)))``, layer 0 without input norm, no final norm. The mapping:

* ``input_proj`` = ``fc`` with its two halves swapped (MiMo puts the hidden half first);
* ``hidden_layernorm.weight`` = the target's final-norm weight, so ``hidden_layernorm(h_t)`` is the target's
  post-norm state exactly (same eps);
* ``token_layernorm.weight`` and the layer's ``input_layernorm.weight`` = a constant each, the mean RMS of the
  embedding rows / of the ``fc`` output measured on ``prompts.json`` (calibration: these two norms have no EAGLE-1
  counterpart, so the head is close to, not equal to, the EAGLE-1 draft);
* ``final_layernorm.weight`` = ones x the mean RMS of the draft's output (a uniform weight keeps each row's argmax);
* q/k/v biases zeros; the rest of the layer as is.

Deterministic (no sampling). bf16 weights, about 4.9 MB, written at test / bench time (not committed).
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

HERE = Path(__file__).resolve().parent
TARGET = HERE / "llama_h64" / "target"
EAGLE1 = HERE / "llama_h64" / "draft_eagle1"
PROMPTS = HERE / "prompts.json"


def _read(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _rms(x: torch.Tensor) -> torch.Tensor:
    return x.float().pow(2).mean(-1).sqrt()


@torch.no_grad()
def calibrate(target_dir: Path, fc: torch.Tensor, n_prompts: int = 16) -> dict[str, float]:
    """Mean RMS of the embedding rows used, of ``fc(cat(embed(x_{t+1}), post_norm(h_t)))`` and of the EAGLE-1
    draft's pre-norm output, over the first ``n_prompts`` of prompts.json run through the target (transformers)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer  # lazy: only the builder needs transformers

    tok = AutoTokenizer.from_pretrained(str(target_dir))
    model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    prompts = json.loads(PROMPTS.read_text())["prompts"][:n_prompts]
    emb_rms, fc_rms = [], []
    for p in prompts:
        ids = tok(p, return_tensors="pt").input_ids
        out = model(ids, output_hidden_states=True)
        h = out.hidden_states[-1][0]                 # post-norm (transformers applies model.norm to the last)
        e = model.model.embed_tokens(ids[0, 1:])
        x = F.linear(torch.cat([e, h[:-1]], -1), fc.float())
        emb_rms.append(_rms(e))
        fc_rms.append(_rms(x))
    return {"embed_rms": float(torch.cat(emb_rms).mean()), "fc_rms": float(torch.cat(fc_rms).mean())}


def build(out: Path, target_dir: Path = TARGET, eagle1_dir: Path = EAGLE1) -> dict:
    """Write the MiMo pair to ``out`` (see the module docstring); returns the calibration constants."""
    out.mkdir(parents=True, exist_ok=True)
    tcfg = json.loads((target_dir / "config.json").read_text())
    n = int(tcfg["num_hidden_layers"])
    H = int(tcfg["hidden_size"])
    t = _read(target_dir / "model.safetensors")
    d = _read(eagle1_dir / "model.safetensors")
    cal = calibrate(target_dir, d["fc.weight"])
    w: dict[str, torch.Tensor] = dict(t)
    for i in range(n):
        for p in ("q", "k", "v"):
            rows = t[f"model.layers.{i}.self_attn.{p}_proj.weight"].shape[0]
            w[f"model.layers.{i}.self_attn.{p}_proj.bias"] = torch.zeros(rows, dtype=torch.bfloat16)
    m = "model.mtp_layers.0."
    fc = d["fc.weight"]
    w[m + "input_proj.weight"] = torch.cat([fc[:, H:], fc[:, :H]], dim=1).contiguous()
    w[m + "hidden_layernorm.weight"] = t["model.norm.weight"].clone()
    w[m + "token_layernorm.weight"] = torch.full((H,), cal["embed_rms"], dtype=torch.bfloat16)
    w[m + "input_layernorm.weight"] = torch.full((H,), cal["fc_rms"], dtype=torch.bfloat16)
    w[m + "final_layernorm.weight"] = torch.ones(H, dtype=torch.bfloat16)
    for k, v in d.items():
        if k.startswith("layers.0."):
            w[m + k[len("layers.0."):]] = v
    for p in ("q", "k", "v"):
        w[m + f"self_attn.{p}_proj.bias"] = torch.zeros(d[f"layers.0.self_attn.{p}_proj.weight"].shape[0],
                                                         dtype=torch.bfloat16)
    save_file({k: v.contiguous() for k, v in w.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = dict(tcfg)
    cfg.update({"architectures": ["MiMoForCausalLM"], "model_type": "qwen2", "num_nextn_predict_layers": 1,
                "use_sliding_window": False, "sliding_window": None, "max_window_layers": n,
                "e3f_mtp_source": {"converted_from": "llama_h64/draft_eagle1 (EAGLE-1, trained)",
                                   "builder": "env/models/make_mimo_pair.py", **cal}})
    cfg.pop("attention_bias", None)
    cfg.pop("mlp_bias", None)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    for f in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        if (target_dir / f).is_file():
            shutil.copy(target_dir / f, out / f)
    return cal


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    a = ap.parse_args(argv)
    print(json.dumps(build(a.out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
