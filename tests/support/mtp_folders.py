"""A model folder holding only an MTP config (and, optionally, a safetensors index naming tensors), for the config
checks' unit tests (``tests/unit/draft/test_mtp_*.py``)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional


def config_folder(tmp: Path, name: str, cfg: dict, index: Optional[list[str]] = None, **edit) -> Path:
    """``tmp/name`` with ``config.json`` = ``cfg`` updated by ``edit`` (a field edited to None is removed) and, when
    ``index`` is given, a ``model.safetensors.index.json`` whose weight map names those tensors (no weights)."""
    d = tmp / name
    d.mkdir()
    c = {**cfg, **edit}
    for k in [k for k, v in c.items() if v is None]:
        c.pop(k)
    (d / "config.json").write_text(json.dumps(c))
    if index is not None:
        (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {k: "m.safetensors" for k in index}}))
    return d
