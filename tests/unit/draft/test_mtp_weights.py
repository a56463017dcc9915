"""The weights check of an MTP / NextN head (helpers/draft/mtp_weights.py) on the generated weights faults
(tests/support/mtp_faults.py WEIGHT_CLASSES) written into copies of the Kimi-class target: an own vs the shared
head, NextN tensors missing from the checkpoint the engine loads."""
from __future__ import annotations

import json
from itertools import count

import pytest
import torch
from safetensors import safe_open

from helpers.draft.loader import load_draft
from helpers.draft.mtp_checks import MTPSpec, check_mtp
from helpers.draft.mtp_weights import compare_tensors, head_weight_findings
from helpers.engines.vllm_rules import VLLMMTPRules
from helpers.errors import BadInput
from support.mtp_faults import TARGET, WEIGHT_CLASSES, MTPFault, draw, write_faulty_target


def _first(pred) -> MTPFault:
    return next(f for f in (draw(s, WEIGHT_CLASSES) for s in count()) if pred(f))


def _kinds(fs) -> list[str]:
    return sorted(f["kind"] for f in fs)


def test_the_clean_target_has_its_head_and_copies_equal_to_its_own():
    facts: dict = {}
    assert head_weight_findings(TARGET, TARGET, facts=facts) == []
    assert facts["head_weights"]["missing"] == {}
    assert [(c["tensor"], c["equal"]) for c in facts["own_copies"]] == [
        ("model.layers.8.shared_head.head.weight", True), ("model.layers.8.embed_tokens.weight", True)]


@pytest.mark.parametrize("which", ["head", "embed"])
def test_a_stale_copy_is_named_with_its_difference_and_costs_the_served_head_nothing(tmp_path, which):
    f = _first(lambda f: f.kind == "own_head" and f.params["mode"] == "copy" and f.params["which"] == which)
    folder = write_faulty_target(f, tmp_path / "t")
    found = head_weight_findings(folder, folder)
    kind = "lm_head_replaced" if which == "head" else "embedding_replaced"
    assert _kinds(found) == [kind]
    ev = found[0]["evidence"]
    # Gaussian noise of `fraction` x RMS: the relative Frobenius difference is that fraction (4096 x 128 entries)
    assert ev["rel_diff"] == pytest.approx(f.params["fraction"], rel=0.05)
    assert "deepseek_weight_loader.py" in ev["source"] and "init_lm_head" in ev["source"]
    v = head_weight_findings(folder, folder, VLLMMTPRules())
    assert _kinds(v) == [kind] and "_maybe_share_lm_head" in v[0]["evidence"]["source"]
    # the head as served (the target's embedding and lm_head) is the clean one, tensor for tensor
    served, clean = load_draft(folder, folder), load_draft(TARGET, TARGET)
    assert torch.equal(served.embed, clean.embed) and torch.equal(served.lm_head, clean.lm_head)
    assert all(torch.equal(served.w[k], clean.w[k]) for k in clean.w)
    # diagnose on the folders says the same before launch
    rep = check_mtp(folder, folder, spec=MTPSpec(num_steps=1, topk=1))
    assert [x["kind"] for x in rep.findings] == [kind]


@pytest.mark.parametrize("which", ["head", "embed"])
def test_a_head_trained_with_its_own_copy_is_exact_with_it_and_loses_with_the_targets(tmp_path, which):
    f = _first(lambda f: f.kind == "own_head" and f.params["mode"] == "trained" and f.params["which"] == which
               and f.params["fraction"] > 0.3)
    folder = write_faulty_target(f, tmp_path / "t")
    assert _kinds(head_weight_findings(folder, folder)) == [
        "lm_head_replaced" if which == "head" else "embedding_replaced"]
    clean, served = load_draft(TARGET, TARGET), load_draft(folder, folder)
    own = load_draft(folder, folder)
    name = f"model.layers.8.{'shared_head.head' if which == 'head' else 'embed_tokens'}.weight"
    with safe_open(str(folder / "model.safetensors"), framework="pt") as sf:
        t = sf.get_tensor(name).float()
    if which == "head":
        own.lm_head = t
    else:
        own.embed = t
    g = torch.Generator().manual_seed(0)
    T = 24
    tokens = torch.randint(0, 4096, (T,), generator=g)
    hidden = torch.randn(T, 128, generator=g)
    lc, lo, ls = (h.extend(tokens, hidden).logits for h in (clean, own, served))
    # with its own copy the faulty head is the clean head (float32 rounding only) ...
    assert (lo - lc).abs().max() < 1e-3 * lc.abs().max()
    assert torch.equal(lo.argmax(-1), lc.argmax(-1))
    # ... and served with the target's copy (as both engines serve it) its logits are another function
    assert (ls - lc).norm() / lc.norm() > 0.1


@pytest.mark.parametrize("group", ["layer", "own", "attention", "experts"])
def test_missing_tensors_are_named_before_launch_and_refused_offline(tmp_path, group):
    f = _first(lambda f: f.kind == "missing" and f.params["group"] == group)
    with safe_open(str(TARGET / "model.safetensors"), framework="pt") as sf:
        before = set(sf.keys())
    folder = write_faulty_target(f, tmp_path / "t")
    with safe_open(str(folder / "model.safetensors"), framework="pt") as sf:
        gone = before - set(sf.keys())
    expect = {n for n in gone if n.split(".", 3)[3] not in ("embed_tokens.weight", "shared_head.head.weight")}
    rep = check_mtp(folder, folder, spec=MTPSpec(num_steps=1, topk=1))
    miss = [x for x in rep.findings if x["kind"] == "mtp_weights_missing"]
    assert len(miss) == 1 and set(miss[0]["evidence"]["missing"]["model.layers.8."]) == expect
    assert "SGLang starts anyway" in miss[0]["detail"]
    if group == "own" and "enorm.weight" in f.params["tensors"]:
        served_as = dict(x.split(" -> ") for x in miss[0]["detail"].split("served as: ")[1].split("; "))
        assert served_as[next(k for k in served_as if "enorm" in k)] == "ones (RMSNorm init)"
    if group == "experts":
        assert "uninitialised memory (torch.empty)" in miss[0]["detail"]
    v = check_mtp(folder, folder, spec=MTPSpec(num_steps=1), rules=VLLMMTPRules())
    assert "Following weights were not initialized" in next(
        x for x in v.findings if x["kind"] == "mtp_weights_missing")["detail"]
    with pytest.raises(BadInput, match="no tensor model.layers.8."):
        load_draft(folder, folder)


def test_compare_tensors_reads_in_blocks_and_says_shapes_apart(tmp_path):
    from safetensors.torch import save_file
    a = torch.randn(37, 5)
    b = a.clone()
    b[36, 4] += 1.0
    save_file({"a": a, "b": b, "c": a[:, :4].contiguous()}, str(tmp_path / "x.safetensors"))
    p = tmp_path / "x.safetensors"
    r = compare_tensors((p, "a"), (p, "b"), block_rows=8)
    assert not r["equal"] and r["max_abs"] == pytest.approx(1.0) and r["rel_diff"] == pytest.approx(
        1.0 / float(b.norm()), rel=1e-5)
    assert compare_tensors((p, "a"), (p, "a"), block_rows=8)["equal"]
    r = compare_tensors((p, "a"), (p, "c"))
    assert not r["equal"] and (r["shape"], r["other_shape"], r["rel_diff"]) == ([37, 5], [37, 4], None)
    with pytest.raises(BadInput, match="cannot compare"):
        compare_tensors((p, "a"), (p, "nope"))
    json.dumps(r)
