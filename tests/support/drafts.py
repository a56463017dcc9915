"""Damaged copies of the reference draft for the acceptance-budget tests: faults after the capture point that no
aux hidden state shows (noisy weights, a wrong d2t)."""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Sequence

import torch
from safetensors.torch import load_file, save_file

from . import ROOT

DRAFT = ROOT / "env" / "models" / "draft"


def damaged_draft(out: Path, *, tensors: Sequence[str] = ("fc.weight", "midlayer.self_attn.q_proj.weight",
                                                          "midlayer.self_attn.k_proj.weight",
                                                          "midlayer.mlp.gate_proj.weight"),
                  noise: float = 1.0, seed: int = 0, src: Path = DRAFT) -> Path:
    """A copy of ``src`` whose ``tensors`` get Gaussian noise of ``noise`` x each tensor's own std (same dtype)."""
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, out / f.name)
    w = load_file(str(src / "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    for k in tensors:
        t = w[k].float()
        w[k] = (t + noise * t.std() * torch.randn(t.shape, generator=g)).to(w[k].dtype)
    save_file(w, str(out / "model.safetensors"))
    return out


def wrong_d2t_draft(out: Path, *, seed: int = 0, src: Path = DRAFT) -> Path:
    """A copy of ``src`` whose d2t maps each draft id to another draft id's target token (a permutation of the
    target ids the draft vocabulary covers: the map of another training run), t2d unchanged."""
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, out / f.name)
    w = load_file(str(src / "model.safetensors"))
    d2t = w["d2t"]
    hot = d2t + torch.arange(d2t.shape[0])
    perm = torch.randperm(hot.shape[0], generator=torch.Generator().manual_seed(seed))
    w["d2t"] = (hot[perm] - torch.arange(d2t.shape[0])).to(d2t.dtype)
    save_file(w, str(out / "model.safetensors"))
    return out


def own_embedding_draft(out: Path, *, target: Path, seed: int = 1, noise: float = 1.0, src: Path = DRAFT) -> Path:
    """A copy of ``src`` that carries an ``embed_tokens.weight`` of its own: ``target``'s embedding plus Gaussian
    noise of ``noise`` x its std (same dtype), as an export that saved a drifted copy of the embedding. SGLang runs
    the draft with the target's embedding, vLLM with this one (``LoaderRules.TABLE`` ``embedding``)."""
    damaged_draft(out, tensors=(), src=src)
    w = load_file(str(out / "model.safetensors"))
    emb = load_file(str(target / "model.safetensors"))["model.embed_tokens.weight"]
    g = torch.Generator().manual_seed(seed)
    w["embed_tokens.weight"] = (emb + torch.randn(emb.shape, generator=g) * noise * emb.float().std()).to(emb.dtype)
    save_file(w, str(out / "model.safetensors"))
    return out
