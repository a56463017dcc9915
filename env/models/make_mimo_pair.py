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

The MTP layer is a trained MiMo MTP head, ``llama_h64/mimo_mtp/model.safetensors`` (``train_mimo_mtp.py``: trained
on the target's pre-norm state as vLLM feeds it, its log ``nextn_training_log.json``). vLLM's MiMo layer
(``mimo_mtp.py::MiMoMultiTokenPredictorLayer.forward``)::

    x   = input_proj(cat(hidden_layernorm(h_t), token_layernorm(embed(x_{t+1}))))   hidden half first
    y   = Qwen2DecoderLayer(x)         with its input_layernorm
    out = final_layernorm(y + residual)                                 logits = lm_head(out)

with ``h_t`` the target's state **before** its final norm (``mimo.py::MiMoModel.forward`` returns
``hidden_states + residual``; ``MiMoForCausalLM.compute_logits`` applies ``model.norm``).

Written beside the weights, so the draft stage of ``investigate`` finds them (``helpers.draft.nextn_stage``: the log
in the target folder, its ``validation_rows.path`` relative to the log):

* ``nextn_training_log.json``: the trainer's log, copied;
* ``validation/``: the log's validation rows, SpecForge layout (``rows_0-32/data_{j}.ckpt``: ``input_ids [113]``,
  ``loss_mask`` ones, ``aux_hidden_state [1, 113, H]`` = ``out(7)``, the pre-norm state the head reads,
  ``hidden_state [1, 113, H]`` the post-norm state, float32) + ``capture.json`` (``layer_ids.specforge_out_i``
  ``[7]``). The ids are the committed EAGLE-1 validation rows' (``llama_h64/draft_eagle1/validation``, the same
  sampled sequences: the trainers share their data and split); the states are recomputed by the committed target
  (:func:`e3f_models.mimo_mtp.target_states`, as the trainer computed the log's figure), so no state is committed
  twice.

Deterministic (no sampling). The pair's bf16 weights are about 5.1 MB, the rows 3.7 MB, written at test / bench time
(not committed).
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

HERE = Path(__file__).resolve().parent
TARGET = HERE / "llama_h64" / "target"
HEAD = HERE / "llama_h64" / "mimo_mtp"
EAGLE1_VAL = HERE / "llama_h64" / "draft_eagle1" / "validation"
LOG_NAME = "nextn_training_log.json"


def _read(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


@torch.no_grad()
def write_validation_rows(out: Path, target_dir: Path = TARGET, ids_from: Path = EAGLE1_VAL) -> Path:
    """``out/rows_0-N/data_{j}.ckpt`` + ``out/capture.json`` (module docstring) from the ids of ``ids_from``'s rows,
    the states by ``target_dir`` run in transformers (float32, CPU)."""
    sys.path.insert(0, str(HERE))
    from e3f_models.mimo_mtp import target_states      # lazy: only the builder needs transformers
    from e3f_models.target import load_target
    files = sorted(ids_from.glob("rows_*/data_*.ckpt"), key=lambda p: int(p.stem.split("_")[1]))
    ids = torch.stack([torch.load(p, weights_only=True)["input_ids"] for p in files])
    target = load_target(target_dir)
    pre, post = target_states(target, ids)
    n = int(ids.shape[0])
    rows = out / f"rows_0-{n}"
    rows.mkdir(parents=True, exist_ok=True)
    for j in range(n):
        torch.save({"input_ids": ids[j].clone(), "loss_mask": torch.ones_like(ids[j]),
                    "aux_hidden_state": pre[j][None].contiguous().clone(),
                    "hidden_state": post[j][None].contiguous().clone()}, rows / f"data_{j}.ckpt")
    L = int(json.loads((target_dir / "config.json").read_text())["num_hidden_layers"])
    (out / "capture.json").write_text(json.dumps({
        "format": "specforge_hidden_states_v1 (rows_{g}-{g+N}/data_{i}.ckpt)", "backend": "hf",
        "capture": "a forward hook on the last decoder layer (out(n-1), before the final norm: what vLLM hands "
                   "MiMo's MTP head)",
        "layer_ids": {"specforge_out_i": [L - 1], "hf_hidden_states_index": [L]},
        "hidden_state": "after the target's final RMSNorm", "dtype": "float32", "samples": n,
        "tokens": int(ids.numel()), "split": "validation", "sequences": "sampled at temperature 1.0",
        "records": f"the ids of {ids_from.relative_to(HERE)} (the validation split train_mimo_mtp.py and "
                   "train_eagle1.py share), states recomputed by e3f_models/mimo_mtp.py::target_states",
        "builder": "env/models/make_mimo_pair.py"}, indent=2) + "\n")
    return out


def build(out: Path, target_dir: Path = TARGET, head_dir: Path = HEAD, *, rows: bool = True) -> dict:
    """Write the MiMo pair to ``out`` (module docstring): weights, config, tokenizer files, the head's training log
    and (``rows``) its validation rows. Returns what was assembled."""
    out.mkdir(parents=True, exist_ok=True)
    tcfg = json.loads((target_dir / "config.json").read_text())
    n = int(tcfg["num_hidden_layers"])
    t = _read(target_dir / "model.safetensors")
    head = _read(head_dir / "model.safetensors")
    w: dict[str, torch.Tensor] = dict(t)
    for i in range(n):
        for p in ("q", "k", "v"):
            rows_ = t[f"model.layers.{i}.self_attn.{p}_proj.weight"].shape[0]
            w[f"model.layers.{i}.self_attn.{p}_proj.bias"] = torch.zeros(rows_, dtype=torch.bfloat16)
    bad = [k for k in head if not k.startswith("model.mtp_layers.0.")]
    if bad:
        raise SystemExit(f"{head_dir / 'model.safetensors'}: tensors outside model.mtp_layers.0.: {bad[:3]}")
    w.update(head)
    save_file({k: v.contiguous() for k, v in w.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = dict(tcfg)
    cfg.update({"architectures": ["MiMoForCausalLM"], "model_type": "qwen2", "num_nextn_predict_layers": 1,
                "use_sliding_window": False, "sliding_window": None, "max_window_layers": n,
                "e3f_mtp_source": {"trained": str(head_dir.relative_to(HERE)) if head_dir.is_relative_to(HERE)
                                   else str(head_dir), "trainer": "env/models/train_mimo_mtp.py",
                                   "builder": "env/models/make_mimo_pair.py"}})
    cfg.pop("attention_bias", None)
    cfg.pop("mlp_bias", None)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    for f in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        if (target_dir / f).is_file():
            shutil.copy(target_dir / f, out / f)
    if (head_dir / LOG_NAME).is_file():
        shutil.copy(head_dir / LOG_NAME, out / LOG_NAME)
    if rows:
        write_validation_rows(out / "validation", target_dir)
    return {"out": str(out), "head": str(head_dir), "tensors": len(head), "rows": rows}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--no-rows", action="store_true", help="skip the validation rows (the server needs none)")
    a = ap.parse_args(argv)
    print(json.dumps(build(a.out, rows=not a.no_rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
