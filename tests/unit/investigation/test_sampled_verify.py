"""The sampled-verify probe without a server: the premise it rests on (a target-only sampling verify accepts exactly
the draft nodes that equal the token it emits), checked on a Python port of SGLang's kernel on random trees; the
probe's decision on the reference draft's drafting chain over its training samples (clean: the identity; a verify
that accepts by an independent coin: a counted loss); the test-only fault's cut on real tensors; the probe's
sampling checks and where it does not apply."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import torch

from helpers.acceptance.requests import PER_REQUEST_COLUMNS
from helpers.budget import Budget
from helpers.draft import simulate as sm
from helpers.draft.budget import training_sequences
from helpers.draft.model import Eagle3Draft
from helpers.errors import BadInput
from helpers.formats.training_data import TrainingData
from helpers.investigation.probes import ProbeContext, _one, probes
from helpers.engines.sglang import SGLangAdapter
from helpers.engines.vllm import VLLMAdapter
from helpers.investigation.probes.sampled import DEFAULT_SAMPLING, probe_sampling, sampled_result
from helpers.paths import REFERENCE_DRAFT, REFERENCE_TARGET, REFERENCE_TRAINING
from support.verify_faults import cut_rows


# --- the premise: SGLang's TreeSpeculativeSamplingTargetOnly, ported line by line ---------------------------------

def target_only(children, tokens, probs, coins, final_coin, *, single=1.0, acc=1.0, remove_rejected=True):
    """``sglang/kernels/jit/include/sgl_kernel/speculative/sampling.cuh::TreeSpeculativeSamplingTargetOnly`` for one
    request: ``children[node]`` the child nodes in sibling order (node 0 the root), ``tokens[node]`` the draft token,
    ``probs[node]`` the target's distribution after ``node`` (numpy, sums to 1), ``coins[node]`` the coin used after
    accepting ``node``. Returns ``(accepted path of nodes, emitted tokens)``; ``remove_rejected`` False is a broken
    kernel that samples the final token from the whole distribution."""
    path, emitted, cur, coin = [0], [], 0, coins[0]
    while True:
        prob_acc, accepted = 0.0, None
        residual = probs[cur].copy()
        for ch in children.get(cur, []):
            p = probs[cur][tokens[ch]]
            prob_acc += p
            if p > 0 and (coin < prob_acc / acc or p >= single):
                accepted = ch
                break
            if remove_rejected:
                residual[tokens[ch]] = 0.0              # draft_probs[x] = target_probs[x]: relu(p - q) is 0 at x
        if accepted is None:
            break
        path.append(accepted)
        emitted.append(tokens[accepted])
        cur, coin = accepted, coins[accepted]
    cdf = np.cumsum(residual / residual.sum())
    emitted.append(int(min(np.searchsorted(cdf, final_coin, side="right"), len(cdf) - 1)))
    return path, emitted


def greedy_walk(children, tokens, emitted):
    """``verify_tree_greedy_func``'s rule on the emitted tokens (what the offline chain applies): from the root,
    follow the child whose token is the next emitted token."""
    path, cur = [0], 0
    for tok in emitted:
        nxt = next((ch for ch in children.get(cur, []) if tokens[ch] == tok), None)
        if nxt is None:
            break
        path.append(nxt)
        cur = nxt
    return path


def random_tree(rng, vocab, depth, topk):
    """A draft tree as EAGLE builds one: each node's children distinct tokens, up to ``topk`` per node."""
    children, tokens, frontier, n = {}, {0: -1}, [0], 1
    for _ in range(depth):
        nxt = []
        for node in frontier:
            k = int(rng.integers(1, topk + 1))
            kids = list(range(n, n + k))
            n += k
            for ch, tok in zip(kids, rng.choice(vocab, size=k, replace=False)):
                tokens[ch] = int(tok)
            children[node] = kids
            nxt += kids
        frontier = nxt[:topk]
    return children, tokens, n


@pytest.mark.parametrize("topk,single,acc", [(1, 1.0, 1.0), (3, 1.0, 1.0), (1, 0.3, 0.6), (3, 0.3, 0.6)])
def test_target_only_verify_accepts_exactly_the_nodes_the_emitted_tokens_walk(topk, single, acc):
    """At every coin, for chains and trees and with relaxed thresholds: the accepted path is the greedy walk of the
    emitted tokens, so the offline chain on the sampled continuation predicts the accept length exactly."""
    rng = np.random.default_rng(topk * 10 + int(single * 10))
    vocab, accepted_some = 12, 0
    for _ in range(400):
        children, tokens, n = random_tree(rng, vocab, depth=3, topk=topk)
        probs = {i: rng.dirichlet(np.full(vocab, 0.3)) for i in range(n)}
        for i in range(n):                            # make the drafts likely enough to be accepted at times
            for ch in children.get(i, []):
                probs[i][tokens[ch]] += 0.5
            probs[i] /= probs[i].sum()
        path, emitted = target_only(children, tokens, probs, rng.random(n), rng.random(), single=single, acc=acc)
        assert greedy_walk(children, tokens, emitted) == path
        accepted_some += len(path) > 1
    assert accepted_some > 100                        # the identity was tested on accepted drafts, not only on none


def test_a_kernel_that_keeps_rejected_drafts_in_the_residual_breaks_the_identity():
    """The check above can fail: without the rejected draft removed from the residual, the emitted token is at times
    a rejected draft, which the greedy walk then counts as accepted."""
    rng = np.random.default_rng(1)
    vocab, differ = 12, 0
    for _ in range(400):
        children, tokens, n = random_tree(rng, vocab, depth=3, topk=1)
        probs = {i: rng.dirichlet(np.full(vocab, 0.3)) for i in range(n)}
        path, emitted = target_only(children, tokens, probs, rng.random(n), rng.random(), remove_rejected=False)
        differ += greedy_walk(children, tokens, emitted) != path
    assert differ > 5


# --- the decision on the reference draft's drafting chain ----------------------------------------------------------

@pytest.fixture(scope="module")
def chain():
    """Per-row accepted drafts of the reference draft's chain (steps 3) on its 16 training samples, and the offline
    per-request frame of the same walk."""
    draft = Eagle3Draft.load(REFERENCE_DRAFT, REFERENCE_TARGET)
    seqs = training_sequences(TrainingData(REFERENCE_TRAINING, hidden_size=128))
    acc = []
    for s in seqs:
        T = int(s.tokens.shape[0])
        ext = draft.extend(s.tokens[1:], s.aux[: T - 1])
        acc.append((s, sm._chain_accepts(sm._teacher_forced(draft, ext, s, 3, s.tokens), 3)))
    st = sm.DraftSettings(3, 1, 4)
    offline = sm.simulate_sequences(draft, seqs, [st], max_new_tokens=24)["per_request"][st]
    return acc, offline


def _frame(acc, cut=None, seed=0):
    """A live per-request frame from the walk over ``acc``; ``cut``: each accepted draft kept with that probability
    (the test-only fault's independent coin)."""
    rng = np.random.default_rng(seed)
    rows = []
    for i, (s, a) in enumerate(acc):
        a = a.copy()
        if cut is not None:
            for r in range(len(a)):
                keep = 0
                while keep < a[r] and rng.random() < cut:
                    keep += 1
                a[r] = keep
        w = sm._walk(a, s.start, int(s.tokens.shape[0]), 3, 24)
        row = {c: None for c in PER_REQUEST_COLUMNS}
        row.update(idx=i, prompt_id=s.key, kind="live", has_spec=True, error=None, prompt_tokens=s.start,
                   completion_tokens=w["completion_tokens"], verify_ct=w["verify_ct"],
                   correct_drafts=w["correct_drafts"], proposed_drafts=3 * w["verify_ct"],
                   accept_length=w["completion_tokens"] / w["verify_ct"])
        rows.append(row)
    return pd.DataFrame(rows, columns=PER_REQUEST_COLUMNS)


def test_clean_sampled_verify_is_an_exact_identity(chain):
    acc, offline = chain
    live = _frame(acc)
    assert live["verify_ct"].tolist() == offline["verify_ct"].tolist()     # the walk is the simulator's own
    r = sampled_result(offline, live, sampling=DEFAULT_SAMPLING, cold=live).to_json()
    assert r["decision"] == "clear" and r["findings"] == []
    assert r["loss"]["delta"] == 0 and r["evidence"]["exact_prompts"] == 16 == r["evidence"]["paired"]
    assert 1.5 < r["evidence"]["offline_accept_length"] == r["evidence"]["live_accept_length"] < 4.0


def test_a_verify_that_accepts_by_an_independent_coin_counts(chain):
    acc, offline = chain
    live = _frame(acc, cut=0.5, seed=3)
    r = sampled_result(offline, live, sampling={**DEFAULT_SAMPLING, "temperature": 0.7}, cold=offline).to_json()
    assert r["decision"] == "counts", r["loss"]
    al_off, al_live = r["evidence"]["offline_accept_length"], r["evidence"]["live_accept_length"]
    assert al_off - al_live > 0.4 and r["loss"]["ci"][0] > 0, (al_off, al_live, r["loss"])
    assert r["evidence"]["exact_prompts"] < 16
    (f,) = r["findings"]
    assert f["kind"] == "sampled_verify_loses_acceptance" and f["evidence"]["temperature"] == 0.7
    assert f"{al_live:.2f}" in f["detail"] and f"{al_off:.2f}" in f["detail"]


def test_no_answered_request_is_a_failed_probe(chain):
    acc, offline = chain
    live = _frame(acc)
    live["verify_ct"], live["error"] = 0, "HTTP 500: boom"
    r = sampled_result(offline, live, sampling=DEFAULT_SAMPLING).to_json()
    assert r["status"] == "failed" and "HTTP 500: boom" in r["why"]


def _expand_check(equal: bool) -> dict:
    """A worker-extension ``verify_sampling`` answer: vLLM's expand of temperatures [0.5, 2.0] to 1 + 2 rows,
    correct or the uninitialised values the CPU override returns."""
    got = [0.5, 2.0, 2.0] if equal else [0.0, 1.7e31, "nan"]
    return {"function": "vllm.v1.sample.rejection_sampler.expand_batch_to_tokens", "cu_num_draft_tokens": [1, 3],
            "fields": {"temperature": {"sent": [0.5, 2.0], "dtype": "float32", "expanded": got,
                                       "expected": [0.5, 2.0, 2.0], "equal": equal}}, "equal": equal}


def test_a_failed_expand_check_names_the_sampling_values_not_the_accept_rule(chain):
    """The vLLM adapter turns a failed ``verify_sampling`` check into the fault (values sent and returned, the
    function), the probe names ``verify_sampling_params_wrong`` with it whatever the gap, and never
    ``sampled_verify_loses_acceptance`` beside it: the accept rule was not what failed. A passing or absent check
    changes nothing."""
    acc, offline = chain
    ad = VLLMAdapter()
    info = {"version": "0.32.0", "device": "cpu"}
    assert ad.verify_sampling_fault(info) is None
    assert ad.verify_sampling_fault({**info, "verify_sampling": _expand_check(True)}) is None
    assert ad.verify_sampling_fault({**info, "verify_sampling": {"error": "ImportError: x"}}) is None
    fault = ad.verify_sampling_fault({**info, "verify_sampling": _expand_check(False)})
    assert "[0.5, 2.0] -> [0.0, 1.7e+31, 'nan']" in fault["detail"] and "_expand_kernel_impl" in fault["detail"]
    assert SGLangAdapter().verify_sampling_fault({**info, "verify_sampling": _expand_check(False)}) is None
    for cut, want in ((None, "clear"), (0.5, "counts")):
        live = _frame(acc, cut=cut, seed=3)
        r = sampled_result(offline, live, sampling=DEFAULT_SAMPLING, cold=offline, params_fault=fault).to_json()
        assert r["decision"] == want, r["loss"]
        (f,) = r["findings"]
        assert f["kind"] == "verify_sampling_params_wrong" and f["evidence"]["loss"]["decision"] == want
        assert f["evidence"]["probe"]["verify_sampling"]["fields"]["temperature"]["equal"] is False
        assert f"gap {want}" in f["detail"] and "expand_batch_to_tokens" in f["detail"]
    assert "sampling values" in ad.sampling_rule({**info, "verify_sampling": _expand_check(False)})
    assert "sampling values" not in ad.sampling_rule({**info, "verify_sampling": _expand_check(True)})


# --- the test-only fault, on real tensors --------------------------------------------------------------------------

def test_the_fault_cuts_accepted_drafts_and_keeps_the_emitted_tokens():
    """Two requests of a chain of 3 drafts (4 nodes each): both accepted 3. Row 0's target is sure of each accepted
    draft (no cut possible), row 1's is uniform over 50 tokens (a cut is almost certain). ``predict`` is left as it
    is: the emitted tokens stay the same."""
    V, N = 50, 4
    logits = torch.full((2 * N, V), -30.0)
    predict = torch.tensor([7, 8, 9, 10, 17, 18, 19, 20], dtype=torch.int32)
    for r in range(N):
        logits[r, int(predict[r])] = 30.0             # row 0: the target puts all mass on the accepted token
    logits[N:] = 0.0                                  # row 1: uniform
    accept_index = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]], dtype=torch.int32)
    accept_lens = torch.tensor([4, 4], dtype=torch.int32)
    before = predict.clone()
    gen = torch.Generator().manual_seed(0)
    n = cut_rows(predict, accept_lens, accept_index, logits, torch.ones(2, 1), torch.tensor([True, True]), gen)
    assert n == 1 and accept_lens.tolist()[0] == 4 and accept_lens.tolist()[1] < 4
    k = int(accept_lens[1])
    assert accept_index[1, :k].tolist() == [4, 5, 6, 7][:k] and (accept_index[1, k:] == -1).all()
    assert torch.equal(predict, before)
    # a row not picked is never cut
    lens = torch.tensor([4, 4], dtype=torch.int32)
    idx = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]], dtype=torch.int32)
    assert cut_rows(predict, lens, idx, logits, torch.ones(2), torch.tensor([False, False]), gen) == 0
    assert lens.tolist() == [4, 4]


# --- sampling checks, where the probe does not apply ---------------------------------------------------------------

def test_probe_sampling_defaults_and_bad_values():
    ctx = SimpleNamespace(sampling=None)
    assert probe_sampling(ctx) == {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "sampling_seed": 0}
    assert probe_sampling(SimpleNamespace(sampling={"temperature": 0.6, "top_k": 20}))["top_k"] == 20
    with pytest.raises(BadInput, match=r"temperature in \[1e-05, 10\]") as e:
        probe_sampling(SimpleNamespace(sampling={"temperature": 0.0}))
    assert "--probe-temperature" in str(e.value)
    with pytest.raises(BadInput, match=r"top-p in \[0.01, 1\]"):
        probe_sampling(SimpleNamespace(sampling={"top_p": 1.5}))
    with pytest.raises(BadInput, match="top-k of -1"):
        probe_sampling(SimpleNamespace(sampling={"top_k": 0}))


@pytest.mark.parametrize("bad, flag", [
    # below both engines' greedy threshold (SGLang 1e-6, vLLM 1e-5): decoded greedily, the probe would check nothing
    ({"temperature": 1e-9}, "--probe-temperature"), ({"temperature": 9e-6}, "--probe-temperature"),
    ({"temperature": float("inf")}, "--probe-temperature"), ({"temperature": float("nan")}, "--probe-temperature"),
    ({"temperature": 1e308}, "--probe-temperature"), ({"temperature": 1e-320}, "--probe-temperature"),
    ({"top_p": 1e-320}, "--probe-top-p"), ({"top_p": 0.001}, "--probe-top-p"),
    ({"top_p": float("nan")}, "--probe-top-p"),
    ({"top_k": 1}, "--probe-top-k"), ({"top_k": 10 ** 20}, "--probe-top-k"),
    ({"top_k": (1 << 30) + 1}, "--probe-top-k"),
])
def test_a_greedy_or_absurd_probe_sampling_is_refused_naming_the_flag(bad, flag):
    with pytest.raises(BadInput) as e:
        probe_sampling(SimpleNamespace(sampling={"temperature": 0.7, **bad}))
    assert e.value.field == flag
    # the edges themselves are sampled: taken
    ok = probe_sampling(SimpleNamespace(sampling={"temperature": 1e-5, "top_p": 0.01, "top_k": 2}))
    assert (ok["temperature"], ok["top_p"], ok["top_k"]) == (1e-5, 0.01, 2)


def test_investigate_cli_refuses_a_greedy_probe_sampling_before_any_folder(tmp_path, capsys):
    from helpers.__main__ import main
    for argv, flag in ((["--probe-temperature", "1e-9"], "--probe-temperature"),
                       (["--probe-top-k", "1"], "--probe-top-k"),
                       (["--probe-top-k", "100000000000000000000"], "--probe-top-k"),
                       (["--timeout", "inf"], "--timeout")):
        assert main(["investigate", "--url", "http://127.0.0.1:1", "--training", str(tmp_path), "--out",
                     str(tmp_path / "out"), *argv]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and flag in err[0], err
    assert not (tmp_path / "out").exists()


def test_server_rules_the_offline_chain_cannot_predict():
    sg, vl = SGLangAdapter(), VLLMAdapter()
    assert sg.sampled_verify_refusal({"speculative_algorithm": "EAGLE3"}) is None
    assert vl.sampled_verify_refusal({"draft_sample_method": "greedy", "rejection_sample_method": "standard"}) is None
    assert "sample_draft_proposal" in sg.sampled_verify_refusal({"speculative_use_rejection_sampling": True})
    assert "'probabilistic'" in vl.sampled_verify_refusal({"draft_sample_method": "probabilistic"})
    assert "'block'" in vl.sampled_verify_refusal({"rejection_sample_method": "block"})
    assert "_verify_uses_greedy" in sg.verify_note({"device": "cpu"})
    assert sg.verify_note({"device": "cuda"}) is None and vl.verify_note({"device": "cpu"}) is None


def test_sampled_verify_is_cheap_and_skips_without_a_draft(tmp_path):
    assert [p.cost for p in probes() if p.name == "sampled_verify"] == ["cheap"]
    client = SimpleNamespace(server_info=lambda refresh=False: {}, timeout=5.0)
    ctx = ProbeContext(client=client, adapter=SimpleNamespace(label="fake"), att=SimpleNamespace(restart=None),
                       run_dir=tmp_path, prompts=[], max_new_tokens=16, dl=Budget(600.0))
    r = _one(next(p for p in probes() if p.name == "sampled_verify"), ctx, "cheap")
    assert r.status == "skipped" and "cannot run offline" in r.why


def test_a_gap_the_engine_has_at_temperature_0_too_is_not_the_sampled_verify(chain):
    """A draft the engine computes differently loses at every temperature: the gap at T is measured again at T = 0
    and only the part beyond it is the sampled verify's (the budget's engine stage owns the rest)."""
    acc, offline = chain
    at_t = _frame(acc, cut=0.5, seed=3)
    everywhere = sampled_result(offline, at_t, sampling=DEFAULT_SAMPLING,
                                greedy=(offline, _frame(acc, cut=0.5, seed=4))).to_json()
    assert everywhere["evidence"]["gap"]["decision"] == "counts"
    assert everywhere["decision"] != "counts" and everywhere["findings"] == []
    loss = everywhere["loss"]
    assert abs(loss["delta"]) < 0.25 and loss["gap_at_t"] > 0.4 and loss["gap_at_0"] > 0.4, loss
    assert "the acceptance budget's engine stage" in everywhere["why"]
    only_t = sampled_result(offline, at_t, sampling=DEFAULT_SAMPLING, greedy=(offline, _frame(acc))).to_json()
    assert only_t["decision"] == "counts" and only_t["loss"]["gap_at_0"] == 0, only_t["loss"]
    assert only_t["loss"]["delta"] == pytest.approx(only_t["loss"]["gap_at_t"])
    assert "beyond the gap of 0.00 at temperature 0" in only_t["findings"][0]["detail"]


def test_capture_sampling_reaches_both_engines_requests(tmp_path):
    """The capture's sampling: greedy by default; a seed per prompt (seed + index); vLLM's field names on its
    ``/v1/completions`` requests (``_send`` with a recording client)."""
    from helpers.capture import sampling_params
    from helpers.engines.vllm_capture import _send, vllm_sampling
    assert sampling_params(None, 3) == {"temperature": 0.0, "ignore_eos": True}
    assert sampling_params({"temperature": 0.8, "sampling_seed": 10}, 3)["sampling_seed"] == 13
    assert vllm_sampling(None, 0) == (0.0, {})
    assert vllm_sampling({"temperature": 0.7, "top_p": 0.9, "top_k": 5, "sampling_seed": 3}, 2) == (
        0.7, {"top_p": 0.9, "top_k": 5, "seed": 5})
    sent = []
    client = SimpleNamespace(rpc=lambda *a, **k: None, reset_prefix_cache=lambda: None,
                             complete=lambda ids, **kw: sent.append(kw) or {"choices": [{"token_ids": [1, 2]}]})
    _send(client, [[5, 6, 7], [8, 9]], tmp_path, 4, False, None, {"temperature": 1.0, "sampling_seed": 0})
    assert [(k["temperature"], k["extra"].get("seed"), k["max_tokens"]) for k in sent] == [(1.0, 0, 4), (1.0, 1, 4)]


class ServedAdapter(SGLangAdapter):
    """An SGLang adapter whose ``capture_served`` writes the reference training samples as a served dump (prompt =
    the tokens before the sample's start, the continuation after it, its own aux rows) and appends live records
    from the chain walk: cut by the fault's independent coin when the sampling has a temperature > 0 and
    ``fault_at_t``, or everywhere with ``fault_always``."""

    label = "fake"

    def __init__(self, acc, *, fault_at_t=False, fault_always=False):
        self.acc, self.fault_at_t, self.fault_always, self.calls = acc, fault_at_t, fault_always, []

    def capture_served(self, client, prompts, out_dir, *, name, max_new_tokens, records, max_width, sampling=None):
        from helpers.formats.dumps import write_dump
        self.calls.append((name, sampling, max_new_tokens))
        samples = [{"key": s.key, "sample_id": s.key, "hidden": s.aux[: int(s.tokens.shape[0]) - 1],
                    "input_ids": s.tokens[: int(s.tokens.shape[0]) - 1], "output_ids": s.tokens[s.start:],
                    "num_prompt_tokens": s.start} for s, _ in self.acc]
        sampled = bool(sampling and sampling.get("temperature", 0) > 0)
        cut = 0.5 if self.fault_always or (self.fault_at_t and sampled) else None
        records.extend(_frame(self.acc, cut=cut, seed=len(self.calls)).to_dict("records"))
        return write_dump(out_dir / name, samples, {"kind": "served"})


def _probe_ctx(tmp_path, adapter):
    # dtype float32: the probe's draft (helpers.draft.precision.server_dtype) computes as the chain fixture's does
    client = SimpleNamespace(server_info=lambda refresh=False: {"device": "cpu", "dtype": "float32"}, timeout=5.0)
    att = SimpleNamespace(restart=None, draft_dir=REFERENCE_DRAFT, target_dir=REFERENCE_TARGET, version="0.5.23",
                          spec={"num_steps": 3, "topk": 1, "num_draft_tokens": 4})
    return ProbeContext(client=client, adapter=adapter, att=att, run_dir=tmp_path, prompts=list(range(16)),
                        max_new_tokens=24, dl=Budget(600.0), sampling={"temperature": 0.8})


@pytest.mark.parametrize("case", ["clean", "fault_at_t", "fault_always"])
def test_the_probe_end_to_end_on_served_dumps(tmp_path, chain, case):
    """The probe's own run: the capture at the probe's sampling, the draft offline on the dump it wrote, the live
    records paired; a counted gap measured again greedy, and counted only when it is not there at T = 0."""
    acc, _ = chain
    ad = ServedAdapter(acc, fault_at_t=case == "fault_at_t", fault_always=case == "fault_always")
    r = _one(next(p for p in probes() if p.name == "sampled_verify"), _probe_ctx(tmp_path, ad), "cheap").to_json()
    assert r["status"] == "ran", r
    assert ad.calls[0] == ("sampled", {**DEFAULT_SAMPLING, "temperature": 0.8}, 24)
    assert "_verify_uses_greedy" in r["why"]                       # the server_info says cpu
    if case == "clean":
        assert r["decision"] == "clear" and len(ad.calls) == 1       # no greedy arm when nothing counts
        assert r["evidence"]["exact_prompts"] == 16
        return
    assert [c[0] for c in ad.calls] == ["sampled", "greedy"] and ad.calls[1][1] is None
    assert (tmp_path / "engine_state" / "sampled_verify" / "greedy_offline.parquet").exists()
    assert r["evidence"]["gap"]["decision"] == "counts"
    if case == "fault_at_t":
        assert r["decision"] == "counts" and r["loss"]["gap_at_0"] == 0
        assert [f["kind"] for f in r["findings"]] == ["sampled_verify_loses_acceptance"]
    else:
        assert r["decision"] != "counts" and r["findings"] == [] and r["loss"]["gap_at_0"] > 0.4


def test_investigate_refuses_a_bad_probe_sampling_before_any_work(tmp_path):
    from helpers.errors import BadInput
    from helpers.investigation.live import investigate
    from helpers.investigation.probes.sampled import check_sampling
    assert check_sampling(None)["temperature"] == DEFAULT_SAMPLING["temperature"]
    assert check_sampling({"temperature": 0.7, "top_k": 20}) == {**DEFAULT_SAMPLING, "temperature": 0.7, "top_k": 20}
    for bad, flag in (({"temperature": 0.0}, "--probe-temperature"), ({"top_p": 1.5}, "--probe-top-p"),
                      ({"top_k": 0}, "--probe-top-k")):
        with pytest.raises(BadInput) as e:
            investigate("http://127.0.0.1:9", training="x", run_dir=tmp_path / "run", probe_sampling=bad)
        assert flag in str(e.value)
        assert not (tmp_path / "run" / "dumps").exists()       # refused before the run folder was filled
