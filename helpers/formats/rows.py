"""What a data set's rows are: its own record (``capture.json``), the split they belong to and the kind of text their
continuations are. Light (no torch): the CLI's argument checks read it."""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from ..errors import BadInput
from ..runfiles import read_json_file


def data_manifest(path: str | Path) -> Optional[tuple[dict, Path]]:
    """The data set's own record, ``capture.json`` (written by ``env/models/make_draft_data.py``; any data folder
    may carry one), looked for in the folder of ``path`` and its two parents.

    Returns:
        ``(document, path of capture.json)`` or None when there is none.

    Raises:
        BadInput: a ``capture.json`` that is not a JSON object, or not a regular file (a FIFO, a device, a symlink
            loop: :func:`helpers.runfiles.read_json_file`, naming it).
    """
    p = Path(path)
    folder = p if p.is_dir() else p.parent
    for cand in (folder, folder.parent, folder.parent.parent):
        m = cand / "capture.json"
        if not os.path.lexists(m):
            continue
        # the one bounded reader: a FIFO, /dev/zero, a symlink loop or a folder named capture.json is refused by
        # name, never taken for "no record" (the plan would fall back to inferred ids without a word)
        doc = read_json_file(m, "capture.json (the data set's record)")
        if not isinstance(doc, dict):
            raise BadInput(f"expected a JSON object, got {type(doc).__name__}", path=m)
        return doc, m
    return None


#: what a row's continuation is: the target's own sampled text, its greedy text, a mix, or text the target did not
#: write (a data set's own responses)
TEXT_KINDS = ("sampled", "greedy", "mixed", "dataset")
#: which part of a training run a row belongs to
SPLITS = ("validation", "training")
_SPLIT_WORDS = {"validation": "validation", "val": "validation", "eval": "validation", "test": "validation",
                "heldout": "validation", "held-out": "validation", "train": "training", "training": "training"}


@dataclass
class RowsKind:
    """What a data set's rows are, and where each answer came from.

    Attributes:
        split: ``validation`` | ``training`` | None (unknown).
        text: one of :data:`TEXT_KINDS`, or None (unknown).
        source: ``{"split": where it came from, "text": where it came from}`` (a file and field, "--flag", or
            "inferred: ..."); absent keys are unknown.
    """

    split: Optional[str] = None
    text: Optional[str] = None
    source: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"split": self.split, "text": self.text, "source": dict(self.source)}


def text_kind(description: str) -> Optional[str]:
    """The text kind a description names: ``"HF greedy on cpu"`` -> greedy, ``"sampled at temperature 1.0"`` ->
    sampled, ``"HF on cuda: 0 greedy + 4000 sampled ..."`` -> sampled (counts read), both non-zero -> mixed, None when
    it says neither."""
    d = description.lower()
    g = re.search(r"(\d+)\s+greedy", d)
    sm = re.search(r"(\d+)\s+sampled", d)
    if g or sm:
        ng = int(g.group(1)) if g else 0
        ns = int(sm.group(1)) if sm else 0
        return "mixed" if ng and ns else "sampled" if ns else "greedy" if ng else None
    if "sampled" in d or "temperature" in d:
        return "sampled"
    if "greedy" in d:
        return "greedy"
    if "dataset" in d or "response" in d:
        return "dataset"
    return None


def split_word(word: str) -> Optional[str]:
    """``validation`` / ``training`` for a split name (``eval``, ``val``, ``test``, ``train``, ...), else None."""
    return _SPLIT_WORDS.get(str(word).strip().lower())


def rows_kind(path: str | Path, *, split: Optional[str] = None, text: Optional[str] = None) -> RowsKind:
    """What the rows under ``path`` are: the user's word first (``split`` / ``text``, e.g. from ``--rows``), then the
    data set's manifest (``capture.json``: ``split``, ``sequences``).

    Raises:
        BadInput: a ``split`` / ``text`` given that is not one of :data:`SPLITS` / :data:`TEXT_KINDS`; an unreadable
            manifest."""
    k = RowsKind()
    if split is not None:
        if split_word(split) is None:
            raise BadInput(f"split {split!r}: expected one of {', '.join(SPLITS)}", field="--rows")
        k.split, k.source["split"] = split_word(split), "the user (--rows)"
    if text is not None:
        if text not in TEXT_KINDS:
            raise BadInput(f"text {text!r}: expected one of {', '.join(TEXT_KINDS)}", field="--rows")
        k.text, k.source["text"] = text, "the user (--rows)"
    got = data_manifest(path)
    if got is not None:
        doc, m = got
        if k.split is None and isinstance(doc.get("split"), str) and split_word(doc["split"]):
            k.split, k.source["split"] = split_word(doc["split"]), f"{m} (split)"
        if k.text is None and isinstance(doc.get("sequences"), str) and text_kind(doc["sequences"]):
            k.text, k.source["text"] = text_kind(doc["sequences"]), f"{m} (sequences: {doc['sequences']!r})"
    return k
