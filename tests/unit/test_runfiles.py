"""helpers.runfiles: atomic writes keep the umask's mode (a shared page must not come out 0600), the JSON
converter, and the reader of user-named JSON files."""
from __future__ import annotations

import math
import os
import stat
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers.errors import BadInput
from helpers.runfiles import atomic_write_text, jsonable, read_json_file


def test_atomic_write_mode_follows_the_umask(tmp_path):
    old = os.umask(0o022)
    try:
        p = atomic_write_text(tmp_path / "page.html", "<p>x</p>")
    finally:
        os.umask(old)
    assert stat.S_IMODE(p.stat().st_mode) == 0o644 and p.read_text() == "<p>x</p>"
    assert not list(tmp_path.glob(".*.tmp"))


def test_jsonable_converts_numbers_tensors_and_paths():
    out = jsonable({"a": np.float32(1.23456789), 2: (np.int64(3), np.bool_(True)), "t": torch.tensor([1.5, 2.0]),
                    "p": Path("/x"), "bad": [float("nan"), float("inf")]}, sig=3)
    assert out == {"a": 1.23, "2": [3, True], "t": [1.5, 2.0], "p": "/x", "bad": [None, None]}
    kept = jsonable({"v": -math.inf}, keep_inf=True)["v"]
    assert kept == -math.inf


@pytest.mark.parametrize("text, needle", [("", "is an empty file"), ("{", "not valid JSON, or truncated"),
                                          ("[" * 100000, "too deeply")])
def test_read_json_file_errors_name_the_file(tmp_path, text, needle):
    p = tmp_path / "config.json"
    p.write_text(text)
    with pytest.raises(BadInput) as e:
        read_json_file(p, "draft config")
    assert needle in str(e.value) and str(p) in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(BadInput, match="not found"):
        read_json_file(tmp_path / "missing.json", "draft config")
