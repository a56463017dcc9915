"""Captures from a live reference server: served aux hidden states, the SGLang reference capture
(many layer ids), the HF reference, and per-rank dumps, all checked against HF transformers on the
same weights."""
from __future__ import annotations

import json

import pytest
import torch

from helpers.capture import (capture_reference, capture_reference_hf, capture_served, per_rank_dumps,
                             reference_server_args, start_reference_server)
from helpers.formats.dumps import read_dump
from helpers.hooks import CaptureConfig, Fault, hook_specs
from helpers.server.embedded import start

pytestmark = pytest.mark.server

PROMPTS = [[5, 17, 42, 99, 7, 250, 31, 8], [12, 13, 14, 15, 300, 301, 2, 9, 88, 21, 65]]


@pytest.fixture(scope="module")
def hf(tiny_target):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_target, torch_dtype=torch.float32).eval()


def _hf_states(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids]), output_hidden_states=True).hidden_states


def test_reference_server_args():
    args, tensors = reference_server_args(8)
    assert tensors == [f"out({i})" for i in range(7)]
    assert args[:4] == ["--enable-return-aux-hidden-states", "--speculative-algorithm", "EAGLE3",
                        "--return-aux-hidden-state-layer-ids"]
    with pytest.raises(ValueError, match="cannot be captured"):
        reference_server_args(8, [0, 7])  # out(7) = capture index 8: past the layer loop


def test_served_capture_and_per_rank_dumps(tmp_path, tiny_target, tiny_draft, hf):
    cap = tmp_path / "cap"
    specs = hook_specs([Fault("embedding_in_place_of_layer", chunk=0)],
                       CaptureConfig(out_dir=str(cap), keys=["embedding", "embedding_local"],
                                     armed_by_file=True), num_layers=8)
    with start(tiny_target, tiny_draft, tp=2, forward_hooks=specs, timeout=300) as srv:
        assert not cap.exists() or not any(cap.rglob("*.safetensors"))  # not armed: nothing written
        cap.mkdir(parents=True, exist_ok=True)
        (cap / "ARMED").write_text("x")
        dump = capture_served(srv, PROMPTS, tmp_path / "dumps", name="served", max_new_tokens=3,
                              progress=False)
        (cap / "ARMED").unlink()
    src = read_dump(dump)
    man = json.loads((dump / "manifest.json").read_text())
    assert man["kind"] == "served" and man["tp_size"] == 2 and man["sglang_version"] == "0.5.23"
    assert "api_key" not in json.dumps(man["server"]) or man["server"].get("api_key") in (None, "<redacted>")
    assert len(src.samples) == 2
    for s, ids in zip(src.samples, PROMPTS):
        rows = s.load()
        assert s.first_position == 0 and rows.shape[1] == 3 * 64
        seq = s.input_ids.tolist()
        assert seq[:len(ids)] == ids and rows.shape[0] == len(ids) + 2  # prompt + 2 decode rows
        st = _hf_states(hf, seq)
        # chunk 0 is the embedding (the injected fault), chunks 1-2 are out(3), out(4) = HF 4, 5
        torch.testing.assert_close(rows[:, :64], st[0][0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(rows[:, 64:], torch.cat([st[4][0], st[5][0]], -1), atol=2e-4, rtol=2e-4)
    # per-rank dumps: one per rank, the prefill forwards of the two prompts
    ranks = per_rank_dumps(cap, tmp_path / "ranks", key="embedding_local", hidden_size=64)
    assert len(ranks) == 2
    per = [read_dump(p) for p in ranks]
    assert [p.tp_rank for p in per] == [0, 1] and all(p.tp_size == 2 for p in per)
    for a, b in zip(per[0].samples, per[1].samples):
        assert a.input_ids.tolist() == b.input_ids.tolist()
        st = _hf_states(hf, a.input_ids.tolist())
        torch.testing.assert_close(a.load() + b.load(), st[0][0], atol=1e-6, rtol=1e-6)


def test_sglang_reference_capture_matches_hf_layers(tmp_path, tiny_target, hf):
    handle, tensors = start_reference_server(tiny_target, tp=1, layer_ids=[0, 2, 5], timeout=300)
    with handle:
        dump = capture_reference(handle, PROMPTS[:1], tmp_path, tensors, progress=False)
    src = read_dump(dump)
    assert src.kind == "reference" and src.layer_plan["tensors"] == ["out(0)", "out(2)", "out(5)"]
    rows = src.samples[0].load()
    st = _hf_states(hf, PROMPTS[0])
    expected = torch.cat([st[1][0], st[3][0], st[6][0]], -1)  # out(L) = HF hidden_states[L+1]
    torch.testing.assert_close(rows, expected, atol=2e-4, rtol=2e-4)


def test_hf_reference_has_every_layer(tmp_path, tiny_target, hf):
    dump = capture_reference_hf(tiny_target, PROMPTS[:1], tmp_path, progress=False)
    src = read_dump(dump)
    assert src.layer_plan["tensors"] == ["embedding"] + [f"out({i})" for i in range(8)]
    rows = src.samples[0].load()
    st = _hf_states(hf, PROMPTS[0])
    torch.testing.assert_close(rows[:, :64], st[0][0])
    torch.testing.assert_close(rows[:, 64 * 3:64 * 4], st[3][0])  # out(2)
    # out(7) is the residual before the final norm, not HF's normed last entry
    last = rows[:, 64 * 8:]
    assert (last - st[8][0]).abs().max() > 1e-3
    normed = hf.model.norm(last)
    torch.testing.assert_close(normed, st[8][0], atol=1e-5, rtol=1e-5)
