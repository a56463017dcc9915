"""The per-rank NextN check (helpers/investigation/mtp.py::_every_rank) on a TP 2 server whose every-layer reference
came from the server itself but which records no per-rank capture folder (``attach``'s ``layers_dir`` None): vLLM
0.32.0's worker extension records TP rank 0 only. A fresh `server start --engine vllm --nextn` (TP 2 by default) then
`investigate` died there with ``TypeError: expected str, bytes or os.PathLike object, not NoneType`` (identify_ranks
read the capture folder ``None``); now the check is skipped with a note saying what would enable it."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from helpers.engines.vllm import VLLMAdapter
from helpers.investigation.mtp import _every_rank


class _Rank0Client:
    """A vLLM client whose worker extension answered ``e3f_describe`` for its two TP ranks (what
    :meth:`helpers.engines.vllm_client.VLLMClient.describe` returns once cached)."""

    def describe(self, required: bool = False):
        return [{"rank": 0}, {"rank": 1}]


def _run(tp: int):
    adapter = VLLMAdapter()
    client = _Rank0Client()
    how = adapter.every_layer_source(client, None)          # the server's own capture: the reference it gave
    assert how is not None
    notes, said = [], []
    r = SimpleNamespace(att=SimpleNamespace(tp=tp, layers_dir=None), adapter=adapter, client=client,
                        doc=SimpleNamespace(notes=notes, diagnosis={}), progress=said.append)
    rank0 = [{"kind": "unidentified_chunk", "detail": "rank 0's input matches no layer"}]
    H = 64
    out = _every_rank(r, list(rank0), "/nonexistent/reference", how, torch.ones(H), 1e-6, H, None)
    return out, notes, said, r.doc.diagnosis


def test_tp2_without_a_rank_capture_folder_skips_the_per_rank_check_with_a_note():
    out, notes, said, diagnosis = _run(2)
    assert [f["kind"] for f in out] == ["unidentified_chunk"]        # rank 0's findings, unchanged
    assert "ranks" not in diagnosis                                   # nothing per rank was read
    assert len(notes) == 1 and "TP 2" in notes[0] and "per-rank check was skipped" in notes[0]
    assert "--capture-layers DIR" in notes[0] and "TP rank 0 only" in notes[0]   # what would enable it
    assert said == ["caveat: " + notes[0]]


def test_tp1_has_no_rank_note():
    out, notes, said, diagnosis = _run(1)
    assert [f["kind"] for f in out] == ["unidentified_chunk"] and notes == [] and "ranks" not in diagnosis
