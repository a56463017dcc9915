"""Diagnosis cases on synthetic deep targets with real residual-stream statistics
(:mod:`helpers.diagnosis.synthetic`: massive activations, adjacent layers at cosine 0.90-0.99, outlier dims,
engine noise growing with depth).

The training data come from one engine (``train``), the served rows and the every-layer reference from
another (``served``: the deployment), both bf16 by default, written in the same formats the real tools
write (SpecForge ``data_*.ckpt``, SGLang ``/generate`` responses, e3f dumps) by ``forensic_cases``.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch

from .forensic_cases import SampleSpec, write_generate_json, write_rank_dumps, write_reference, write_specforge
from helpers.diagnosis.synthetic import SyntheticTarget, random_sequences


def specforge_default(n: int) -> list[int]:
    """SpecForge's default ids [1, n//2-1, n-4] (output-of-layer convention)."""
    return [1, n // 2 - 1, n - 4]


def outs(ids) -> list[str]:
    return [f"out({i})" for i in ids]


def write_configs(folder: Path, target: SyntheticTarget, draft_ids: Optional[list[int]], *,
                  architecture: str = "LlamaForCausalLM", nested: bool = True,
                  draft_arch: str = "LlamaForCausalLMEagle3") -> tuple[Path, Path]:
    """A target config.json and a draft config.json (no weights) for the synthetic target."""
    folder = Path(folder)
    tdir, ddir = folder / "target", folder / "draft"
    tdir.mkdir(parents=True, exist_ok=True)
    ddir.mkdir(parents=True, exist_ok=True)
    (tdir / "config.json").write_text(json.dumps({
        "architectures": [architecture], "model_type": "llama", "hidden_size": target.H,
        "num_hidden_layers": target.n, "vocab_size": target.vocab, "torch_dtype": "bfloat16"}))
    d = {"architectures": [draft_arch], "model_type": "llama", "hidden_size": target.H,
         "num_hidden_layers": 1, "vocab_size": target.vocab, "torch_dtype": "bfloat16"}
    if draft_ids is not None:
        if nested:
            d["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(draft_ids), "use_aux_hidden_state": True}
        else:
            d["eagle_aux_hidden_state_layer_ids"] = list(draft_ids)
    (ddir / "config.json").write_text(json.dumps(d))
    return ddir, tdir


@dataclass
class World:
    """One synthetic target with a training engine, a serving engine and sample sequences."""

    target: SyntheticTarget
    train: object
    served: object
    specs: list[SampleSpec]
    folder: Path
    _n: int = field(default=0, repr=False)

    @classmethod
    def make(cls, folder: Path, *, layers: int = 32, hidden: int = 256, noise: float = 1e-2,
             dtype: torch.dtype = torch.bfloat16, samples: int = 4, seed: int = 0, **cfg) -> "World":
        t = SyntheticTarget(num_layers=layers, hidden_size=hidden, seed=seed, **cfg)
        seqs = random_sequences(t, samples, seed=seed + 1)
        specs = [SampleSpec(prompt=p, continuation=c, output_ids=c[:8]) for p, c in seqs]
        return cls(t, t.engine("train", noise=noise, dtype=dtype), t.engine("served", noise=noise, dtype=dtype),
                   specs, Path(folder))

    def sub(self, name: str) -> Path:
        self._n += 1
        p = self.folder / f"{self._n:03d}-{name}"
        p.mkdir(parents=True)
        return p

    def training(self, tensors: list[str], *, manifest_ids: Optional[list[int]] = None) -> Path:
        """SpecForge training data of ``tensors`` (+ ``capture.json`` recording ``manifest_ids`` when given)."""
        out = self.sub("train")
        write_specforge(out, self.train, self.specs, tensors)
        if manifest_ids is not None:
            (out / "capture.json").write_text(json.dumps({"layer_ids": {"specforge_out_i": list(manifest_ids)}}))
        return out

    def served_json(self, tensors: list[str], mutate: Optional[Callable] = None) -> Path:
        return write_generate_json(self.sub("served") / "served.json", self.served, self.specs, tensors,
                                   mutate=mutate)

    def rank_dumps(self, tensors: list[str], tp: int, rank_rows: Optional[Callable] = None) -> list[Path]:
        return write_rank_dumps(self.sub("ranks"), self.served, self.specs, tensors, tp, rank_rows=rank_rows)

    def reference(self) -> Path:
        return write_reference(self.sub("ref") / "ref", self.served, self.specs)

    def configs(self, draft_ids: Optional[list[int]], **kw) -> tuple[Path, Path]:
        return write_configs(self.sub("configs"), self.target, draft_ids, **kw)
