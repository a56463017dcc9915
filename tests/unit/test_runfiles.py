"""helpers.runfiles: atomic writes keep the umask's mode (a shared page must not come out 0600), the JSON
converter, and the reader of user-named JSON files."""
from __future__ import annotations

import errno
import math
import os
import stat
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers.errors import BadInput
from helpers.runfiles import (
    atomic_write_bytes,
    atomic_write_new,
    atomic_write_text,
    jsonable,
    read_json_file,
    staged_folder,
)
from support import alias_bomb


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


def test_yaml_aliases_are_bounded(tmp_path):
    """Issue 21, cause 5: a 10-line alias bomb (9^9 leaves) and a self-referencing alias are refused by the one YAML
    loader with one line naming the file, at once and without growing memory; ordinary aliases still work."""
    from pydantic import BaseModel, ConfigDict

    from helpers.runfiles import MAX_YAML_NODES, load_yaml_model

    class Doc(BaseModel):
        model_config = ConfigDict(extra="allow")

    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(alias_bomb())
    with pytest.raises(BadInput, match=rf"bomb.yaml: params file: its aliases expand to more than {MAX_YAML_NODES}"):
        load_yaml_model(bomb, Doc, what="params file")
    loop = tmp_path / "loop.yaml"
    loop.write_text("a: &a [1, *a]\n")
    with pytest.raises(BadInput, match="loop.yaml: params file: an alias refers to a node that contains it"):
        load_yaml_model(loop, Doc, what="params file")
    ok = tmp_path / "ok.yaml"
    ok.write_text("base: &b {steps: 3, topk: 1}\nfix: *b\nmore: [*b, *b]\n")
    assert load_yaml_model(ok, Doc, what="params file").model_dump()["more"] == [{"steps": 3, "topk": 1}] * 2


def test_json_depth_is_bounded(tmp_path):
    """Issue 21, cause 5: JSON nested deeper than MAX_JSON_DEPTH (even where Python's parser would cope) is refused
    with the file named; the parser's own RecursionError never escapes."""
    from helpers.runfiles import MAX_JSON_DEPTH, JSONTooDeep, loads_json

    for depth in (MAX_JSON_DEPTH + 1, 400, 200000):
        text = '{"a": ' * depth + "1" + "}" * depth
        p = tmp_path / "deep.json"
        p.write_text(text)
        with pytest.raises(BadInput, match=rf"deep.json: manifest nests arrays/objects too deeply "
                                           rf"\(more than {MAX_JSON_DEPTH} levels\)"):
            read_json_file(p, "manifest")
        with pytest.raises(JSONTooDeep):
            loads_json(text.encode())
    wide = {"rows": [[0.5] * 1000 for _ in range(100)], "deep": [[[[[[1]]]]]]}
    import json as _json
    assert loads_json(_json.dumps(wide)) == wide


def test_full_disk_errors_name_the_users_file_never_a_staging_name(tmp_path):
    """Issue 30: on a full disk, a folder staged before its rename (measurements, dumps) and a file written under a
    new name (results/<notebook>-2.json) are named as the user will look for them, not by their temporary name."""
    from support.fakerun import fill, small_tmpfs

    with small_tmpfs(tmp_path / "small", "64k") as mnt:
        if mnt is None:
            pytest.skip("cannot mount a small tmpfs here (needs root)")
        fill(mnt)
        with pytest.raises(OSError) as err:
            with staged_folder(mnt / "run" / "fixes" / "x") as tmp:
                atomic_write_bytes(tmp / "summary.json", b"{}" * 50_000)
        assert err.value.errno == errno.ENOSPC and err.value.filename == str(mnt / "run" / "fixes" / "x" /
                                                                            "summary.json")
        assert [p.name for p in (mnt / "run" / "fixes").iterdir()] == []          # the staging folder is gone
        with pytest.raises(OSError) as err:
            atomic_write_new(mnt / "results" / "20_acceptance.json", b"x" * 200_000)
        assert err.value.errno == errno.ENOSPC and err.value.filename == str(mnt / "results" / "20_acceptance.json")
        assert not list((mnt / "results").iterdir())
