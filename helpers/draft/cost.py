"""One draft forward's cost relative to one verify step (the settings stage's cost model in
:mod:`helpers.draft.budget`), from the parameters each model multiplies by, read from the safetensors headers."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import numpy as np
from safetensors import safe_open

from ..errors import BadInput
from ..formats.configs import read_draft_config, read_target_config
from .params import resolve_name, sglang_parameters


def _weight_files(folder: Path) -> list[Path]:
    """The model's own safetensors files: those its index (``model.safetensors.index.json``) maps, else every
    ``*.safetensors`` in the folder."""
    idx = folder / "model.safetensors.index.json"
    if idx.is_file():
        try:
            wm = json.loads(idx.read_text()).get("weight_map") or {}
            files = sorted({folder / f for f in wm.values()})
            if files and all(f.is_file() for f in files):
                return files
        except (OSError, ValueError, AttributeError):
            pass
    return sorted(folder.glob("*.safetensors"))


def _parameter_counts(folder: Path) -> dict[str, int]:
    """``{tensor name: element count}`` of the floating-point tensors in the model's weight files, from the
    safetensors headers (nothing is loaded; index tensors such as ``d2t`` / ``t2d`` are integer or bool and left
    out)."""
    out: dict[str, int] = {}
    for f in _weight_files(folder):
        try:
            with safe_open(str(f), framework="pt") as h:
                for k in h.keys():
                    sl = h.get_slice(k)
                    if sl.get_dtype() in ("F16", "BF16", "F32", "F64", "F8_E4M3", "F8_E5M2"):
                        out[k] = int(np.prod(sl.get_shape(), dtype=np.int64))
        except Exception as exc:              # a file that is not safetensors: say which
            raise BadInput(f"cannot read its safetensors header ({exc})", path=f) from None
    return out


def _draft_parameters(draft_dir: Path) -> int:
    """Parameters one draft forward multiplies by: the floating tensors SGLang's ``load_weights`` puts into the draft
    (:func:`helpers.draft.params.resolve_name`: a stray tensor it drops is not read), the embedding left out (a
    lookup reads a few rows; SpecForge checkpoints may ship it)."""
    counts = _parameter_counts(draft_dir)
    try:
        arch = sglang_parameters(read_draft_config(draft_dir))
    except BadInput:
        arch = None
    n = 0
    for k, v in counts.items():
        where = resolve_name(arch, k) if arch is not None else k
        if where is None or where in ("d2t", "t2d"):
            continue
        param = where[0] if isinstance(where, tuple) else str(where)
        if "embed_tokens" in param:
            continue
        n += v
    return n


def _beyond_last_layer(name: str, num_layers: Optional[int]) -> bool:
    """A tensor of a layer past the target's last decoder layer (``model.layers.{i}.*`` with ``i >= num_layers``):
    an MTP / NextN head shipped in the target's checkpoint, which the target's verify forward never reads (SGLang
    0.5.23 skips it when loading the target: ``deepseek_common/deepseek_weight_loader.py::do_load_weights``).
    ``num_layers`` None (no readable config): nothing is left out."""
    parts = name.split(".")
    return (num_layers is not None and len(parts) >= 3 and parts[:2] == ["model", "layers"] and parts[2].isdigit()
            and int(parts[2]) >= num_layers)


def _num_layers(target_dir: Path) -> Optional[int]:
    """The target config's ``num_hidden_layers``, None when it cannot be read."""
    try:
        return int(read_target_config(target_dir).num_hidden_layers)
    except (BadInput, TypeError, ValueError):
        return None


def draft_cost(draft_dir: Path, target_dir: Path, *, draft_cost: Optional[float] = None) -> tuple[float, str]:
    """One draft forward's cost relative to one verify step, and where the figure comes from.

    At the small batches where speculative decoding pays, a forward is bound by the weight bytes it reads, and the
    draft and the target are served in one dtype: the ratio of the parameters the draft multiplies by
    (:func:`_draft_parameters`: what SGLang loads into it, its embedding left out) to the target's (every
    floating tensor of its weight files but an MTP / NextN head's layer past its last decoder layer), counted from the safetensors headers, so a float32 checkpoint served in
    bf16 or a stray file beside the weights does not change it. A mixture-of-experts target reads only the experts
    its tokens are routed to, and an untied target embedding is a lookup: the ratio then underestimates the draft's
    share (give ``--draft-cost`` from a timing to override). Without the target's weights here, the target's
    parameters are estimated from its config (12 x hidden^2 x layers + vocab x hidden).

    Raises:
        BadInput: a weight file whose safetensors header cannot be read (names the file)."""
    if draft_cost is not None:
        return float(draft_cost), "given"
    d = _draft_parameters(draft_dir)
    layers = _num_layers(target_dir)                 # read once, not per tensor
    t = sum(n for k, n in _parameter_counts(target_dir).items() if not _beyond_last_layer(k, layers))
    if d and t:
        return d / t, f"parameters: draft {d / 1e6:.2f} M / target {t / 1e6:.2f} M (safetensors headers)"
    tc = read_target_config(target_dir)
    vocab = int(tc.raw.get("vocab_size") or 0)
    params = 12 * tc.hidden_size ** 2 * tc.num_hidden_layers + vocab * tc.hidden_size
    if d and params:
        return d / params, "draft parameters / target parameters estimated from its config"
    return 0.1, "unknown (no weights here): 0.1 assumed"
