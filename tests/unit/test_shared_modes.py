"""A run folder is meant to be shared (issue 21, cause 12): every file and folder this tool writes into it follows
the umask and is never narrower -- measurement folders (``tempfile.mkdtemp`` makes 0700), dump tensors, draft variants
and per-rank capture files (safetensors writes 0600) -- checked with umask 022, 027 and 002."""
from __future__ import annotations

import json
import os
import stat

import pytest
import torch
from safetensors.torch import save_file

from helpers import paths
from helpers.__main__ import main
from helpers.formats.dumps import write_dump
from helpers.hooks import _atomic_save
from helpers.investigation.propose import draft_variant
from support.fakeserver import fake_server


@pytest.fixture(params=[0o022, 0o027, 0o002])
def umask(request):
    old = os.umask(request.param)
    paths._umask.cache_clear()
    yield request.param
    os.umask(old)
    paths._umask.cache_clear()


def _modes(root) -> dict[str, int]:
    return {str(p.relative_to(root)): stat.S_IMODE(p.lstat().st_mode) for p in [root, *root.rglob("*")]
            if not p.is_symlink()}


def _expected(root, umask: int) -> dict[str, int]:
    return {k: (0o777 if (root / k).is_dir() else 0o666) & ~umask for k in _modes(root)}


def test_a_measurement_folder_follows_the_umask(umask, tmp_path, capsys):
    with fake_server("ok") as url:
        assert main(["measure", "--url", url, "--num-prompts", "2", "--max-new-tokens", "4", "--quiet", "--warmup",
                     "0", "--outputs", str(tmp_path), "--label", "x"]) == 0
    (run,) = tmp_path.iterdir()
    modes = _modes(run)
    assert {"fixes", "fixes/x", "fixes/x/summary.json", "ledger.parquet"} <= set(modes)
    assert modes == _expected(run, umask)


def test_dumps_drafts_and_rank_captures_follow_the_umask(umask, tmp_path):
    dump = write_dump(tmp_path / "dumps" / "served", [{"key": "a", "hidden": torch.ones(2, 4), "input_ids": [1, 2]}])
    src = tmp_path / "draft"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0]}}))
    save_file({"w": torch.ones(2, 2), "d2t": torch.zeros(2, dtype=torch.int64)}, str(src / "model.safetensors"))
    fixed = draft_variant(src, {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1]}}, tmp_path / "drafts" / "x",
                          drop_tensors=["d2t"])
    _atomic_save({"aux": torch.ones(2, 4)}, str(tmp_path / "capture" / "rank0" / "fwd000000.safetensors"))
    modes = _modes(tmp_path)
    assert {"dumps/served/tensors.safetensors", "drafts/x/model.safetensors", "drafts/x/config.json",
            "capture/rank0/fwd000000.safetensors"} <= set(modes)
    del modes["."], modes["draft/model.safetensors"]     # made by pytest (0700) / by the test with safetensors
    assert modes == {k: v for k, v in _expected(tmp_path, umask).items() if k in modes}
    assert dump.is_dir() and fixed.is_dir()
