"""The one seam that loads a served draft to run offline: an EAGLE-3 draft folder, an EAGLE-1 draft folder (vLLM
``method: eagle``: :class:`helpers.draft.eagle1.Eagle1Draft`), or the MTP / NextN head of a target
(:func:`helpers.layers.mtp.mtp_head` on its config.json decides which, never a class-name comparison elsewhere).

The offline heads per MTP family (:data:`OFFLINE_HEADS`): ``deepseek_v3`` -> :class:`helpers.draft.nextn.NextNHead`
(SGLang 0.5.23's ``sglang/srt/models/deepseek_nextn.py::DeepseekV3ForCausalLMNextN``), ``mimo`` ->
:class:`helpers.draft.mimo_mtp.MiMoMTPHead` (vLLM 0.32.0's ``mimo_mtp.py::MiMoMTP``). A family without an offline
head is refused with one line.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch

from ..errors import BadInput
from ..formats.configs import read_config_json, read_mtp_head
from .eagle1 import Eagle1Draft, is_eagle1
from .model import Eagle3Draft


def _nextn(draft_dir: Path, target_dir: Path, **kw) -> Eagle3Draft:
    from .nextn import NextNHead  # lazy: transformers' DeepseekV3MoE is slow to import; only a NextN head needs it
    same = Path(draft_dir).resolve() == Path(target_dir).resolve()
    return NextNHead.load(target_dir, draft_dir=None if same else draft_dir, **kw)


def _mimo(draft_dir: Path, target_dir: Path, **kw) -> Eagle3Draft:
    from .mimo_mtp import MiMoMTPHead  # lazy: only a MiMo target's head needs it
    return MiMoMTPHead.load(draft_dir, **kw)


#: MTP family name -> loader(draft_dir, target_dir, dtype=, device=, dtype_reason=)
OFFLINE_HEADS = {"deepseek_v3": _nextn, "mimo": _mimo}


def is_mtp(draft_dir: str | Path) -> bool:
    """The folder's config.json describes an MTP / NextN head (a family's target or head class)."""
    cfg = Path(draft_dir) / "config.json"
    return read_mtp_head(read_config_json(cfg, "draft config"), cfg) is not None


def load_draft(draft_dir: str | Path, target_dir: Optional[str | Path], *, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu", dtype_reason: str = "", loader: Any = None) -> Eagle3Draft:
    """The served draft of ``draft_dir`` run offline as the engine runs it: :meth:`Eagle3Draft.load` for an EAGLE-3
    draft; :meth:`helpers.draft.eagle1.Eagle1Draft.load` for an EAGLE-1 draft (vLLM ``method: eagle``,
    ``EagleLlamaForCausalLM``: its config's ``architectures``, :func:`helpers.draft.eagle1.is_eagle1`); for an MTP / NextN head (``draft_dir`` a target folder with ``num_nextn_predict_layers``, or a separate
    NextN checkpoint) the family's offline head of :data:`OFFLINE_HEADS` (embedding and lm_head from ``target_dir``).
    ``loader``: the serving engine's loader rules (``EngineAdapter.loader_rules``: which embedding, lm_head, d2t and
    norms the engine runs an EAGLE-3 draft with), passed to :meth:`Eagle3Draft.load`; None: SGLang's.

    Raises:
        BadInput: an MTP family with no offline head here (the family and its SGLang class named), no ``target_dir``
            for an MTP head, or whatever the loader refuses (missing tensors, shapes unlike the config)."""
    draft_dir = Path(draft_dir)
    cfg = read_config_json(draft_dir / "config.json", "draft config")
    if is_eagle1(cfg):
        return Eagle1Draft.load(draft_dir, target_dir, dtype=dtype, device=device, dtype_reason=dtype_reason)
    head = read_mtp_head(cfg, draft_dir / "config.json")
    if head is None:
        return Eagle3Draft.load(draft_dir, target_dir, dtype=dtype, device=device, dtype_reason=dtype_reason,
                                loader=loader)
    loader = OFFLINE_HEADS.get(head.family.name)
    if loader is None:
        fam = head.family
        raise BadInput(f"the draft is a {fam.name} MTP head ({fam.head_arch}, {fam.head_file}); "
                       f"the offline head is built for {', '.join(OFFLINE_HEADS)} only", path=draft_dir / "config.json",
                       field="architectures")
    if target_dir is None:
        raise BadInput("an MTP head shares the target's embedding and lm_head: the target folder is needed",
                       path=draft_dir, field="--target")
    return loader(draft_dir, Path(target_dir), dtype=dtype, device=device, dtype_reason=dtype_reason)


__all__ = ["OFFLINE_HEADS", "is_mtp", "load_draft"]
