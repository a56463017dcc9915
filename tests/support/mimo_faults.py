"""A generated fault of the MiMo pair's trained MTP head (``env/models/make_mimo_pair.py``; test fixture, off by
default, no flag reaches it): ``input_proj_scale`` -- one half of ``model.mtp_layers.0.input_proj.weight``
(``[H, 2H]``: columns ``:H`` read ``hidden_layernorm(h_t)``, ``H:`` read ``token_layernorm(embed(x_{t+1}))``, hidden
half first: ``vllm/model_executor/models/mimo_mtp.py::MiMoMultiTokenPredictorLayer.forward``) scaled by ``factor``,
as a wrong per-block quantisation scale would (the NextN head's ``eh_scale``, :mod:`support.mtp_faults`). The stage
that should name it: ``draft`` (the head against its training log)."""
from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

NAME = "model.mtp_layers.0.input_proj.weight"


def write_scaled_input_proj(pair: Path, out: Path, *, half: str = "hidden", factor: float = 0.25) -> Path:
    """A copy of the pair folder ``pair`` (weights, config, tokenizer, training log, validation rows) in ``out`` with
    ``half`` (``hidden`` | ``token``) of ``input_proj`` scaled by ``factor``; every other tensor unchanged.

    Raises:
        ValueError: ``half`` is neither."""
    if half not in ("hidden", "token"):
        raise ValueError(f"half {half!r}: expected hidden or token")
    shutil.copytree(pair, out, dirs_exist_ok=True)
    w = load_file(str(pair / "model.safetensors"))
    t = w[NAME].float().clone()
    H = t.shape[1] // 2
    t[:, slice(0, H) if half == "hidden" else slice(H, 2 * H)] *= factor
    w[NAME] = t.to(w[NAME].dtype)
    save_file(w, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
