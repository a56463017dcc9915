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
from ..runfiles import MAX_TOKEN_ID, JSONTooDeep, loads_json, read_file_text


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
        if not path.exists() and not path.is_symlink():
            raise BadInput("prompt file not found", path=path)
        # a regular file of at most MAX_FILE_BYTES (a FIFO, /dev/zero, a symlink loop: one line, never a hang)
        text = read_file_text(path, "prompt file", expected="JSON lines")
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
                    raise BadInput(f"line {n_line} is not JSON ({getattr(exc, 'msg', None) or exc}); expected one "
                                   "object per line such as "
                                   '{"text": ...} or {"input_ids": [...]}', path=path) from None
    else:
        items = list(source)
    where = (lambda i: f"{'line' if path is not None and path.suffix != '.json' else 'item'} {i + 1}")
    prompts = []
    for i, it in enumerate(items):
        try:
            prompts.append(_prompt(it, i))
        except (TypeError, ValueError, OverflowError) as exc:
            raise BadInput(f"{where(i)}: {exc}", path=path) from None
    if not prompts:
        raise BadInput("the prompt set is empty", path=path)
    if n is not None:
        if not 1 <= n <= MAX_PROMPTS:
            raise BadInput(f"the number of prompts must be from 1 to {MAX_PROMPTS}, got {n}", field="--num-prompts")
        prompts = [prompts[i % len(prompts)] if i < len(prompts) else
                   dataclasses.replace(prompts[i % len(prompts)], id=f"{prompts[i % len(prompts)].id}#{i // len(prompts)}")
                   for i in range(n)]
    return prompts


#: the most prompts one measurement sends (``--num-prompts``, a fixes file's ``count``): a list of that many is built
#: before anything is sent
MAX_PROMPTS = 1_000_000


def _prompt(it: Any, i: int) -> Prompt:
    """One item of a prompt set as a :class:`Prompt`. Raises ValueError / TypeError saying what is wrong."""
    if isinstance(it, Prompt):
        return it
    if isinstance(it, str):
        return Prompt(id=f"u{i:03d}", text=it, kind="user")
    if isinstance(it, Mapping):
        text, ids = it.get("text"), it.get("input_ids")
        if text is None and ids is None:
            raise ValueError("has neither text nor input_ids")
        if text is not None and not isinstance(text, str):
            raise ValueError(f"text must be a string, got {type(text).__name__}")
        return Prompt(id=str(it.get("id", f"u{i:03d}")), text=text,
                      input_ids=token_ids(ids) if ids is not None else None, kind=str(it.get("kind", "")))
    if isinstance(it, (Sequence, np.ndarray)) and len(it) and not isinstance(it, bytes):
        return Prompt(id=f"t{i:03d}", input_ids=token_ids(it), kind="tokens")
    raise ValueError(f"cannot use {type(it).__name__} as a prompt")


def token_ids(ids: Any) -> tuple[int, ...]:
    """``ids`` as a non-empty tuple of token ids: integers in ``[0, 2^31)`` (JSON floats such as ``1.5``, ``1e400``
    or NaN, booleans and strings are refused, not rounded).

    Raises:
        ValueError: not a list, empty, or an id that is not such an integer (its position and value)."""
    if isinstance(ids, (str, bytes, Mapping)) or not isinstance(ids, (Sequence, np.ndarray)):
        raise ValueError(f"input_ids must be a list of token ids, got {type(ids).__name__}")
    out = []
    for k, t in enumerate(np.asarray(ids, dtype=object).reshape(-1).tolist() if isinstance(ids, np.ndarray) else ids):
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < MAX_TOKEN_ID:
            raise ValueError(f"input_ids[{k}] is {t!r}; expected an integer token id from 0 to {MAX_TOKEN_ID - 1}")
        out.append(t)
    if not out:
        raise ValueError("input_ids is empty")
    return tuple(out)


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
