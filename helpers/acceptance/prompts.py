"""Prompts for acceptance measurements: the bundled set, JSONL files, training samples, and a digest that
identifies a prompt set in the ledger.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from importlib import resources
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Sequence

import numpy as np

from ..errors import BadInput
from ..runfiles import JSONTooDeep, loads_json


@dataclasses.dataclass(frozen=True)
class Prompt:
    """One prompt: ``text`` or ``input_ids`` (token ids, e.g. the prompt part of a training sample)."""

    id: str
    text: Optional[str] = None
    input_ids: Optional[tuple[int, ...]] = None
    kind: str = ""

    def __post_init__(self):
        if (self.text is None) == (self.input_ids is None):
            raise ValueError(f"prompt {self.id!r}: give exactly one of text / input_ids")

    def request(self) -> dict:
        return {"text": self.text} if self.text is not None else {"input_ids": list(self.input_ids)}


def bundled_prompts_path() -> Path:
    """Path of the bundled prompt set (``helpers/data/prompts.jsonl``, 48 English prompts)."""
    return Path(str(resources.files("helpers") / "data" / "prompts.jsonl"))


def load_prompts(source: Any = None, n: Optional[int] = None) -> list[Prompt]:
    """Prompts from the bundled set (``source=None``), a ``.jsonl``/``.json`` file, or a list.

    List items may be strings (text), sequences of ints (token ids), dicts with ``text`` or
    ``input_ids`` (optional ``id``, ``kind``), or :class:`Prompt`. Files hold one such dict per
    line (jsonl) or a JSON list. ``n`` keeps the first n (cycling when n exceeds the set).
    Raises:
        BadInput: a missing, unreadable, empty or malformed set (the message names the file and the line or item).
    """
    if source is None:
        source = bundled_prompts_path()
    path: Optional[Path] = None
    if isinstance(source, (str, Path)):
        path = Path(source)
        if path.is_dir():
            raise BadInput("is a folder; expected a .jsonl or .json prompt file", path=path)
        if not path.is_file():
            raise BadInput("prompt file not found", path=path)
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            raise BadInput("not a text file (expected JSON lines)", path=path) from None
        if path.suffix == ".json":
            try:
                items = loads_json(text)
            except json.JSONDecodeError as exc:
                raise BadInput(f"not JSON ({exc.msg} at line {exc.lineno})", path=path) from None
            except JSONTooDeep as exc:
                raise BadInput(f"{exc} (expected a JSON list of prompts)", path=path) from None
            if not isinstance(items, list):
                raise BadInput(f"expected a JSON list of prompts, got {type(items).__name__}", path=path)
        else:
            items = []
            for n_line, line in enumerate(text.splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    items.append(loads_json(line))
                except (json.JSONDecodeError, JSONTooDeep) as exc:
                    raise BadInput(f"line {n_line} is not JSON ({exc.msg}); expected one object per line such as "
                                   '{"text": ...} or {"input_ids": [...]}', path=path) from None
    else:
        items = list(source)
    where = (lambda i: f"{'line' if path is not None and path.suffix != '.json' else 'item'} {i + 1}")
    prompts = []
    for i, it in enumerate(items):
        try:
            if isinstance(it, Prompt):
                prompts.append(it)
            elif isinstance(it, str):
                prompts.append(Prompt(id=f"u{i:03d}", text=it, kind="user"))
            elif isinstance(it, Mapping):
                ids = it.get("input_ids")
                if it.get("text") is None and ids is None:
                    raise ValueError("has neither text nor input_ids")
                prompts.append(Prompt(id=str(it.get("id", f"u{i:03d}")), text=it.get("text"),
                                      input_ids=tuple(int(t) for t in ids) if ids is not None else None,
                                      kind=str(it.get("kind", ""))))
            elif isinstance(it, (Sequence, np.ndarray)) and len(it) and not isinstance(it, bytes):
                prompts.append(Prompt(id=f"t{i:03d}", input_ids=tuple(int(t) for t in it), kind="tokens"))
            else:
                raise ValueError(f"cannot use {type(it).__name__} as a prompt")
        except (TypeError, ValueError) as exc:
            raise BadInput(f"{where(i)}: {exc}", path=path) from None
    if not prompts:
        raise BadInput("the prompt set is empty", path=path)
    if n is not None:
        if n <= 0:
            raise BadInput(f"the number of prompts must be >= 1, got {n}", field="--num-prompts")
        prompts = [prompts[i % len(prompts)] if i < len(prompts) else
                   dataclasses.replace(prompts[i % len(prompts)], id=f"{prompts[i % len(prompts)].id}#{i // len(prompts)}")
                   for i in range(n)]
    return prompts


def prompts_from_samples(samples: Iterable[Any], *, max_prompt_tokens: Optional[int] = None,
                         min_prompt_tokens: int = 1) -> list[Prompt]:
    """Prompts (token ids) from training samples, so served and trained tokens line up.

    Each sample is a sequence of token ids or a mapping with ``input_ids`` and optionally
    ``loss_mask`` (SpecForge / speculators layout: 1 on assistant tokens). With a loss mask the
    prompt is the prefix before the first masked token (the part the draft was conditioned on);
    without, the whole sequence. ``max_prompt_tokens`` truncates. Samples whose prompt is shorter
    than ``min_prompt_tokens`` are skipped. ``id`` / ``sample_id`` of a mapping become the prompt id.
    """
    out = []
    for i, s in enumerate(samples):
        sid = f"s{i:04d}"
        mask = None
        if isinstance(s, Mapping):
            sid = str(s.get("id", s.get("sample_id", sid)))
            ids, mask = s["input_ids"], s.get("loss_mask")
        else:
            ids = s
        ids = [int(t) for t in np.asarray(ids).reshape(-1).tolist()]
        if mask is not None:
            m = np.asarray(mask).reshape(-1)
            nz = np.flatnonzero(m)
            if len(nz):
                ids = ids[:int(nz[0])]
        if max_prompt_tokens is not None:
            ids = ids[:max_prompt_tokens]
        if len(ids) >= min_prompt_tokens:
            out.append(Prompt(id=sid, input_ids=tuple(ids), kind="training"))
    if not out:
        raise ValueError("no usable training sample (all prompts empty?)")
    return out


def prompts_digest(prompts: Sequence[Prompt]) -> str:
    """sha256 (16 hex) of the prompt contents, to tell prompt sets apart in the ledger."""
    h = hashlib.sha256()
    for p in prompts:
        h.update(json.dumps(p.request(), sort_keys=True).encode())
    return h.hexdigest()[:16]
