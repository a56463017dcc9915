"""The NextN investigation at TP > 1 (helpers/investigation/mtp_ranks.py) and its settings fix (mtp_fix.py) on real
tensors: the trained Kimi-class target (env/models/kimi/target) in HF transformers, its greedy continuations of three
bundled prompts and their every-layer reference dump. The per-rank capture folders are written in the format of the
server's hooks (helpers.hooks.write_forward, one file per rank per forward) from those reference tensors, as each
rank's head would read them: all ranks post-norm (SGLang), each rank an un-reduced share summing to out(7), each rank
a 1/tp column shard, one rank fed the pre-norm state."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from helpers.acceptance.prompts import load_prompts
from helpers.capture import capture_reference_hf
from helpers.draft.attention import _rms
from helpers.draft.loader import load_draft
from helpers.draft.model import target_final_norm
from helpers.draft.simulate import DraftSettings, SimSequence
from helpers.formats.dumps import read_dump
from helpers.hooks import write_forward
from helpers.investigation.mtp import POST_NORM, reference_sequences
from helpers.investigation.mtp_fix import measured_cost, modelled_change, nextn_draft_cost, propose, repriced, steps_proof
from helpers.investigation.mtp_ranks import identify_ranks, rank_findings
from support import ROOT

TARGET = ROOT / "env" / "models" / "kimi" / "target"
NEW = 24


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """(sequences with the target's greedy continuation, reference dump, norm weight, eps, {sample id: {tensor name:
    [T, H]}} of the reference)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    if not (TARGET / "model.safetensors").is_file():
        pytest.skip("env/models/kimi/target is not built here")
    tok = AutoTokenizer.from_pretrained(TARGET)
    model = AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()
    seqs = []
    for p in load_prompts(None, n=3):
        ids = tok(p.text)["input_ids"] if p.input_ids is None else list(p.input_ids)
        with torch.no_grad():
            toks = model.generate(torch.tensor([ids]), max_new_tokens=NEW, do_sample=False, min_new_tokens=NEW)[0]
        seqs.append(SimSequence(p.id, toks.clone(), torch.zeros(len(toks), 1), len(ids)))
    ref = capture_reference_hf(TARGET, [{"id": s.key, "input_ids": s.tokens.tolist()} for s in seqs],
                               tmp_path_factory.mktemp("dumps"), progress=False)
    w, eps = target_final_norm(TARGET)
    src = read_dump(ref)
    names = src.layer_plan["tensors"]
    tensors = {}
    for s in src.samples:
        rows = s.load().float()
        H = rows.shape[1] // len(names)
        tensors[s.sample_id] = {n: rows[:, i * H:(i + 1) * H] for i, n in enumerate(names)}
    return seqs, ref, w, eps, tensors


def _capture(world, folder, per_rank, tp=2):
    """A per-rank capture folder: for each sample, rank r's ``aux`` = ``per_rank(tensors, r)``; a stale forward of
    other values first (a reused server keeps earlier runs' forwards: the last one counts)."""
    seqs, ref, w, eps, tensors = world
    n = 0
    for s in seqs:
        t = tensors[s.key]
        for r in range(tp):
            stale = {"input_ids": s.tokens, "aux": torch.zeros_like(per_rank(t, r, w, eps))}
            write_forward(str(folder), r, tp, n, stale, "EXTEND", len(s.tokens))
            write_forward(str(folder), r, tp, n + 1, {"input_ids": s.tokens, "aux": per_rank(t, r, w, eps)},
                          "EXTEND", len(s.tokens))
        n += 2
    return folder


def _post(t, r, w, eps):
    return _rms(t["out(7)"], w, eps)


def _partial(t, r, w, eps):
    # rank r: out(6)/2 + (out(7) - out(6))/2 +- embedding: two shares that differ and sum to out(7) exactly
    return t["out(6)"] / 2 + (t["out(7)"] - t["out(6)"]) / 2 + (1 if r == 0 else -1) * t["embedding"]


def _shard(t, r, w, eps):
    x = _rms(t["out(7)"], w, eps)
    return x[:, r * 64:(r + 1) * 64]


def _rank1_pre_norm(t, r, w, eps):
    return _rms(t["out(7)"], w, eps) if r == 0 else t["out(7)"]


@pytest.mark.parametrize("how, kinds", [(_post, []), (_partial, ["tp_partial_sum"]), (_shard, ["tp_sharded_width"]),
                                        (_rank1_pre_norm, ["norm_mismatch"])])
def test_every_rank_identified(world, tmp_path, how, kinds):
    seqs, ref, w, eps, _ = world
    ir = identify_ranks(_capture(world, tmp_path / "cap", how), ref, w, eps, 128)
    assert ir["tp"] == 2 and ir["samples"] == len(seqs)
    found = rank_findings(ir)
    assert [f["kind"] for f in found] == kinds
    if how is _post:
        assert ir["ranks_agree"] and all(i["identified"] == POST_NORM for i in ir["per_rank"].values())
        assert ir["rank_vs_rank0"][1] == 0.0
    elif how is _partial:
        assert not ir["ranks_agree"] and all(i["identified"] is None for i in ir["per_rank"].values())
        assert ir["sum"]["identified"] == "out(7)" and ir["sum"]["best_rel_error"] < 1e-6
        assert found[0]["evidence"]["sum_identified"] == "out(7)"
    elif how is _shard:
        assert ir["sharded"] and ir["width"] == {0: 64, 1: 64}
        assert ir["gathered"]["identified"] == POST_NORM
    else:
        assert ir["per_rank"][0]["identified"] == POST_NORM and ir["per_rank"][1]["identified"] == "out(7)"
        assert found[0]["evidence"]["tp_rank"] == 1 and found[0]["detail"].startswith("TP rank 1: ")


def test_nextn_draft_cost_counts_active_parameters(world):
    c, src = nextn_draft_cost(TARGET)
    w = load_file(str(TARGET / "model.safetensors"))
    share = 2 / 8                                           # num_experts_per_tok / n_routed_experts of the config

    def active(prefix):
        return sum(v.numel() * (share if ".experts." in k else 1.0) for k, v in w.items()
                   if k.startswith(prefix) and "embed_tokens" not in k and "shared_head.head" not in k)
    lm = w["lm_head.weight"].numel()
    target = sum(active(f"model.layers.{i}.") for i in range(8)) + lm
    head = active("model.layers.8.") + lm
    assert c == pytest.approx(head / target, rel=1e-9) and 0.2 < c < 0.8 and "active parameters" in src
    assert nextn_draft_cost(TARGET, draft_cost=0.3) == (0.3, "given (--draft-cost)")


def test_measured_cost_inverts_the_cost_model():
    c = 0.37
    before = {"num_steps": 3, "accept_length": 1.8, "tok_s": 1.8 / (1 + 3 * c)}
    after = {"num_steps": 1, "accept_length": 1.5, "tok_s": 1.5 / (1 + 1 * c)}
    assert measured_cost(before, after)["cost"] == pytest.approx(c, rel=1e-9)
    assert measured_cost(before, {**after, "num_steps": 3}) is None
    assert measured_cost(before, {**after, "tok_s": 10.0})["cost"] is None      # no positive cost: said


def test_the_proof_priced_again_at_the_measured_cost():
    """The cost model at the parameter ratio and at the cost a relaunch measured, on the steps fix's figures of a
    2026-12-06 run (3 steps 1.64 -> 1 step 1.48, -0.16 [-0.23, -0.11] paired): the proof's +42.6 % at c = 0.409
    (tokens per unit time = accept length / (1 + steps c)); at the measured 0.062 the same accept lengths predict a
    wash, undecided, as the interleaved measurement found. No measured cost: nothing repriced."""
    mc, mlo, mhi, pays = modelled_change(1.64, -0.16, -0.23, -0.11, 3, 1, 0.409)
    assert mc == pytest.approx(1.48 / (1 + 0.409) / (1.64 / (1 + 3 * 0.409)) - 1, rel=1e-12)
    assert mlo < mc < mhi and pays is True and round(mc, 3) == 0.426
    proof = {"served": {"accept_length": 1.64, "steps": 3}, "trained": {"steps": 1}, "delta": -0.16,
             "delta_ci": [-0.23, -0.11], "cost": 0.409}
    before = {"num_steps": 3, "accept_length": 1.64, "tok_s": 1.64 / (1 + 3 * 0.062)}
    after = {"num_steps": 1, "accept_length": 1.48, "tok_s": 1.48 / (1 + 0.062)}
    again = repriced(proof, measured_cost(before, after))
    assert again["cost"] == pytest.approx(0.062, rel=1e-9) and "measured by the relaunch" in again["source"]
    assert again["modelled_ci"][0] < 0 < again["modelled_ci"][1] and again["pays"] is None
    assert again["modelled_change"] == pytest.approx(modelled_change(1.64, -0.16, -0.23, -0.11, 3, 1, 0.062)[0])
    assert repriced(proof, None) is None and repriced(proof, {"cost": None, "why": "x"}) is None


def test_steps_proof_and_proposal(world):
    seqs, ref, w, eps, _ = world
    head = load_draft(TARGET, TARGET)
    refs = reference_sequences(ref, seqs, w, eps)
    served = DraftSettings.chain(3)
    p = steps_proof(head, refs, served, 1, 0.4, "test", max_new_tokens=NEW)
    assert p["served"]["steps"] == 3 and p["trained"]["steps"] == 1 and p["n"] == len(seqs)
    assert p["served"]["accept_length"] >= p["trained"]["accept_length"]   # a deeper chain never accepts fewer
    assert p["delta"] == pytest.approx(p["trained"]["accept_length"] - p["served"]["accept_length"], abs=0.02)
    want = p["trained"]["accept_length"] / 1.4 / (p["served"]["accept_length"] / 2.2) - 1
    assert p["modelled_change"] == pytest.approx(want, abs=0.02)
    sc = {"served_steps": 3, "trained_steps": 1, "untrained": [], "source": "test"}
    fix, withdrawn = propose([{"kind": "mtp_steps_beyond_head", "evidence": sc, "detail": "x"}], p)
    assert fix.server_args == {"--speculative-num-steps": 1, "--speculative-eagle-topk": 1,
                               "--speculative-num-draft-tokens": 2} and fix.applicable
    assert (withdrawn is not None) == (p["pays"] is False)
    # at no head cost the served steps are never slower: the proof rules the gain out, the fix is withdrawn
    free = steps_proof(head, refs, served, 1, 0.0, "test", max_new_tokens=NEW)
    if free["delta"] < 0 and free["delta_ci"][1] < 0:
        assert free["pays"] is False
        assert propose([{"kind": "mtp_steps_beyond_head", "evidence": sc, "detail": "x"}], free)[1]
    # a wrong state comes first: its fix is the engine's, proposed only
    fix2, _ = propose([{"kind": "tp_partial_sum", "detail": "d", "evidence": {}},
                       {"kind": "mtp_steps_beyond_head", "evidence": sc, "detail": "x"}], p)
    assert fix2.kind == "engine" and not fix2.applicable and fix2.unaddressed == ["mtp_steps_beyond_head"]


def test_speed_decision_on_real_measurements():
    """Two recorded before / after measurements of the main job (per-request frames of a live server): the paired time
    per token decides, unless the machine's load moved between them enough to explain it."""
    import pandas as pd
    from helpers.acceptance.machine import speed_change, time_per_token_ratio
    from helpers.acceptance.measure import summarize
    from helpers.investigation.mtp_fix import speed_decision
    base = ROOT / "tests" / "data" / "main_job" / "acceptance"
    a = pd.read_parquet(base / "fix-the-tool-s-proposal" / "per_request.parquet")
    b = pd.read_parquet(base / "fix-the-tool-s-proposal-num_steps-2" / "per_request.parquet")
    sa, sb = (summarize(x, positions=None)[0] for x in (a, b))
    idle = {"cpu_count": 2, "runnable_mean": 1.0}
    tt = time_per_token_ratio(a, b)
    d = speed_decision(speed_change({**sa, "machine": idle}, {**sb, "machine": idle}, a, b))
    want = "faster" if tt["ratio_hi"] < 1 else "slower" if tt["ratio_lo"] > 1 else "undecided"
    assert d["decision"] == want and d["ratio"][0] == pytest.approx(tt["ratio"])
    busy = speed_decision(speed_change({**sa, "machine": {"cpu_count": 2, "runnable_mean": 11.0}},
                                       {**sb, "machine": {"cpu_count": 2, "runnable_mean": 17.5}}, a, b))
    assert busy["decision"] == "undecided" and busy["predicted"] == pytest.approx(17.5 / 11.0)
    same = speed_decision(speed_change(sa, sa, a, a))               # a measurement against itself: no change
    assert same["decision"] == "undecided" and same["ratio"][0] == pytest.approx(1.0)
