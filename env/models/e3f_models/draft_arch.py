"""The draft architectures the trainer can build and export, one entry each (``DRAFT_ARCHS``).

``llama``: ``LlamaForCausalLMEagle3`` (``draft.Eagle3Draft``; what SpecForge trains, for Llama and
for Kimi targets alike); ``mla``: ``Eagle3DeepseekV2ForCausalLM`` (``draft_mla.Eagle3MLADraft``;
SGLang's Kimi MLA draft). ``load_draft`` reads either back from a draft folder by its
``architectures``.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from .draft import Eagle3Draft, llama_draft_config
from .draft_mla import Eagle3MLADraft, mla_draft_config


@dataclass(frozen=True)
class DraftArch:
    """``name``: ``train_draft.py --arch``; ``module``: trainer module class (its
    ``architecture`` is config.json's); ``make_config(target_cfg, draft_vocab, layer_ids, **kw)``:
    the config.json dict."""
    name: str
    module: type
    make_config: Callable[..., dict]

    @property
    def architecture(self) -> str:
        return self.module.architecture


DRAFT_ARCHS = {"llama": DraftArch("llama", Eagle3Draft, llama_draft_config),
               "mla": DraftArch("mla", Eagle3MLADraft, mla_draft_config)}


def arch_of(cfg: dict) -> DraftArch:
    """The arch of a draft config.json dict (``architectures[0]``); ValueError when unknown."""
    name = (cfg.get("architectures") or [None])[0]
    for a in DRAFT_ARCHS.values():
        if a.architecture == name:
            return a
    raise ValueError(f"draft config.json: architectures {cfg.get('architectures')!r}; expected one "
                     f"of {[a.architecture for a in DRAFT_ARCHS.values()]}")


def load_draft(draft_dir: Path, target_dir: Path):
    """``(draft module fp32 eval, target lm_head [V, H] fp32)`` from a draft folder (config.json +
    model.safetensors in SGLang's layout) and its target folder (embedding and lm_head read from
    its model.safetensors; a tied target's lm_head is its embedding). Strict: every checkpoint
    tensor but the shared embedding (ValueError otherwise)."""
    from safetensors.torch import load_file

    draft_dir, target_dir = Path(draft_dir), Path(target_dir)
    cfg = json.loads((draft_dir / "config.json").read_text())
    w = load_file(str(draft_dir / "model.safetensors"))
    tw = load_file(str(target_dir / "model.safetensors"))
    emb = tw["model.embed_tokens.weight"].float()
    d = arch_of(cfg).module(cfg, emb, w["d2t"], w["t2d"])
    d.load_sglang_state_dict(w)
    d.eval()
    return d, tw.get("lm_head.weight", emb).float()


def target_head(target_dir: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """``(embedding [V, H], lm_head [V, H])`` fp32 of a target folder's model.safetensors."""
    from safetensors.torch import load_file
    tw = load_file(str(Path(target_dir) / "model.safetensors"))
    emb = tw["model.embed_tokens.weight"].float()
    return emb, tw.get("lm_head.weight", emb).float()
