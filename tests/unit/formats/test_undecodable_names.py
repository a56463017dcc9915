"""Training files whose names are not UTF-8 (issue 21, cause 11): a valid SpecForge ``.ckpt`` named ``data_\\xff.ckpt``
is read like any other (it was called "truncated or corrupt": torch's mmap cannot open such a name), and its sample
key is text that a dump can hold."""
from __future__ import annotations

import os

import torch

from helpers.formats.dumps import read_dump, write_dump
from helpers.formats.training_data import TrainingData, read_ckpt_sample


def test_a_ckpt_with_a_non_utf8_name_is_read(tmp_path):
    folder = tmp_path / "rows_0-1"
    folder.mkdir()
    g = torch.Generator().manual_seed(0)
    aux = torch.randn(1, 6, 3 * 8, generator=g)
    ids = torch.arange(6) + 10
    path = folder / os.fsdecode(b"data_\xff.ckpt")
    torch.save({"input_ids": ids, "loss_mask": torch.ones(6), "aux_hidden_state": aux}, path)

    s = read_ckpt_sample(path, hidden_size=8)
    assert s.key == "data_#ff" and s.rows == 6 and s.width == 24
    assert torch.equal(s.load(), aux[0]) and s.input_ids.tolist() == ids.tolist()

    (t,) = list(TrainingData(tmp_path, hidden_size=8))
    assert t.key == "data_#ff" and torch.equal(t.load(), aux[0])
    dump = read_dump(write_dump(tmp_path / "dump", [t], {"kind": "training", "hidden_size": 8}))
    (back,) = dump.samples
    assert back.key == "data_#ff" and torch.equal(back.load(), aux[0])
