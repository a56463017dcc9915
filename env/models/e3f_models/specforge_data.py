"""Writer/reader for SpecForge's offline EAGLE-3 training-data format (one sample per file).

Mirrors SpecForge (sgl-project/SpecForge @a6b6b023, ``scripts/prepare_hidden_states.py``
``HiddenStatesGenerator._save_tensor_sync`` / ``_get_file_path`` and
``specforge/data/preprocessing.py::generate_vocab_mapping_file``); see
shared/reference/training-formats.md section 1.1. Layout::

    <root>/rows_{g}-{g+2000}/data_{idx}.ckpt     g = (idx // 2000) * 2000
    <root>/vocab_mapping/vocab_mapping.pt         {"d2t": int64 [draft_vocab], "t2d": bool [target_vocab]}

Each ``.ckpt`` is ``torch.save`` of a dict:

    input_ids         int64 [L]           token ids (no batch dim)
    loss_mask         int64 [L]           1 on the target's own continuation tokens, 0 on the prompt
    aux_hidden_state  bf16  [1, L, 3*H]   concat of the aux layers, ascending layer order
    hidden_state      bf16  [1, L, H]     target last hidden state AFTER the final RMSNorm

Unlike SpecForge's batch-padded capture, ``L`` is the exact sample length (no trailing pad).
Files are always read with ``torch.load(..., weights_only=True)``.
"""
from __future__ import annotations

from collections import Counter
from pathlib import Path

import torch

FILE_GROUP_SIZE = 2000  # SpecForge --file-group-size default
KEYS = ("input_ids", "loss_mask", "aux_hidden_state", "hidden_state")


def record_path(root: Path, idx: int, group: int = FILE_GROUP_SIZE) -> Path:
    """``<root>/rows_{g}-{g+group}/data_{idx}.ckpt`` with ``g = (idx // group) * group``."""
    g = (idx // group) * group
    return Path(root) / f"rows_{g}-{g + group}" / f"data_{idx}.ckpt"


def write_record(root: Path, idx: int, input_ids, loss_mask, aux_hidden_state, hidden_state,
                 dtype=torch.bfloat16) -> Path:
    """Save one sample. ``aux_hidden_state`` [L, 3H] or [1, L, 3H]; ``hidden_state`` [L, H] or
    [1, L, H]; both are stored as ``dtype`` (bf16, as SpecForge stores a bf16 target's states)."""
    ids = torch.as_tensor(input_ids, dtype=torch.long).reshape(-1)
    mask = torch.as_tensor(loss_mask, dtype=torch.long).reshape(-1)
    aux = torch.as_tensor(aux_hidden_state).reshape(1, ids.numel(), -1).to(dtype).contiguous()
    hid = torch.as_tensor(hidden_state).reshape(1, ids.numel(), -1).to(dtype).contiguous()
    assert mask.numel() == ids.numel()
    path = record_path(root, idx)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save({"input_ids": ids.clone(), "loss_mask": mask.clone(), "aux_hidden_state": aux,
                "hidden_state": hid}, tmp)
    tmp.replace(path)
    return path


def read_record(path: Path) -> dict:
    """Load one ``data_{i}.ckpt`` (``weights_only=True``) and check its keys and shapes."""
    d = torch.load(path, map_location="cpu", weights_only=True)
    missing = [k for k in KEYS if k not in d]
    if missing:
        raise ValueError(f"{path}: missing keys {missing}")
    L = d["input_ids"].shape[0]
    if d["aux_hidden_state"].shape[:2] != (1, L) or d["hidden_state"].shape[:2] != (1, L):
        raise ValueError(f"{path}: inconsistent shapes "
                         f"{ {k: tuple(v.shape) for k, v in d.items()} }")
    return d


def list_records(root: Path) -> list[Path]:
    """All ``data_*.ckpt`` under ``root``, ordered by sample index (the vocab file is skipped)."""
    files = [p for p in Path(root).rglob("data_*.ckpt")]
    return sorted(files, key=lambda p: int(p.stem.split("_")[1]))


def build_vocab_mapping(samples, target_vocab: int, draft_vocab: int):
    """``(d2t, t2d, coverage)`` from token frequencies on loss-masked positions.

    Follows SpecForge ``generate_vocab_mapping_file`` / ``process_token_dict_to_mappings``:
    count ``input_ids[loss_mask == 1]``, keep the ``draft_vocab`` most frequent target ids
    (topped up with the lowest unused ids when fewer were seen), sort them ascending, then
    ``d2t[i] = used[i] - i`` (int64, so target id = i + d2t[i]) and ``t2d[v] = v in used`` (bool).
    Ties are broken by the smaller token id (SpecForge breaks them by first occurrence).
    ``samples`` yields ``(input_ids, loss_mask)`` pairs. ``coverage`` = share of counted tokens
    that are in the draft vocabulary.
    """
    counts: Counter = Counter()
    for ids, mask in samples:
        ids = torch.as_tensor(ids).reshape(-1)
        mask = torch.as_tensor(mask).reshape(-1)
        counts.update(ids[mask == 1].tolist())
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:draft_vocab]
    used = {k for k, _ in ranked}
    filler = (v for v in range(target_vocab) if v not in used)
    while len(used) < draft_vocab:
        used.add(next(filler))
    used_sorted = sorted(used)
    d2t = torch.tensor([t - i for i, t in enumerate(used_sorted)], dtype=torch.long)
    t2d = torch.zeros(target_vocab, dtype=torch.bool)
    t2d[used_sorted] = True
    total = sum(counts.values())
    coverage = sum(c for k, c in counts.items() if k in used) / max(total, 1)
    return d2t, t2d, coverage


def write_vocab_mapping(root: Path, d2t: torch.Tensor, t2d: torch.Tensor) -> Path:
    """Save ``{"d2t", "t2d"}`` to ``<root>/vocab_mapping/vocab_mapping.pt``."""
    path = Path(root) / "vocab_mapping" / "vocab_mapping.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"d2t": d2t.to(torch.long), "t2d": t2d.to(torch.bool)}, path)
    return path


def read_vocab_mapping(root: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """Load ``(d2t, t2d)`` from ``<root>/vocab_mapping/vocab_mapping.pt`` (weights_only)."""
    d = torch.load(Path(root) / "vocab_mapping" / "vocab_mapping.pt", map_location="cpu",
                   weights_only=True)
    return d["d2t"], d["t2d"]
