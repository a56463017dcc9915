"""The draft step trace: the hook (helpers.trace_hooks) on fake SGLang calls, the grouping into verify cycles and the
first-divergence logic (helpers.draft.trace) on records made from the reference draft's own offline proposals, then
damaged at one step. The live check on the embedded server: tests/server/test_hooks_live.py."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers.draft.model import Eagle3Draft
from helpers.engines.vllm import VLLMAdapter
from helpers.draft.simulate import SimSequence
from helpers.draft.trace import (compare_request, compare_trace, first_divergence, mechanism, read_trace,
                                 request_cycles, trace_counts)
from helpers.hooks import ARM_FILE
from helpers.investigation.attach import TRACE_FACTORY as ATTACH_TRACE_FACTORY
from helpers.engines.sglang import SGLangAdapter
from helpers.engines.vllm import VLLMAdapter
from helpers.errors import BadInput, RequestRejected
from helpers.investigation.probes.trace import HOW, _applies, trace_dir
from helpers.paths import REFERENCE_DRAFT, REFERENCE_TARGET
from helpers.trace_hooks import TRACE_FACTORY, draft_trace_factory, trace_hook_specs

STEPS = 3


@pytest.fixture(scope="module")
def draft():
    return Eagle3Draft.load(REFERENCE_DRAFT, REFERENCE_TARGET)


@pytest.fixture(scope="module")
def seq(draft):
    g = torch.Generator().manual_seed(0)
    T = 20
    tokens = torch.randint(1, 2000, (T,), generator=g)
    aux = torch.randn(T - 1, draft.arch.num_aux * draft.arch.target_hidden, generator=g)
    return SimSequence("r0", tokens, aux, 10)


def _offline_cycles(draft, seq, rows):
    """The checkpoint's own chain per extend row: ``{row: [(position, input, top1 target, top1 draft), ...]}``."""
    T = int(seq.tokens.shape[0])
    ext = draft.extend(seq.tokens[1:], seq.aux[: T - 1])
    out = {}
    for p in rows:
        d0 = int(ext.logits[p].argmax())
        chain = [(p, int(seq.tokens[p + 1]), int(draft.to_target_ids(torch.tensor(d0))), d0)]
        for k in range(1, STEPS):
            inputs = torch.tensor([[c[2] for c in chain]], dtype=torch.long)
            logits = None
            for kk, _, lg in draft.unroll(ext, torch.tensor([p]), inputs[:, :k]):
                logits = lg[0]
            d = int(logits.argmax())
            chain.append((p + k, chain[-1][2], int(draft.to_target_ids(torch.tensor(d))), d))
        out[p] = chain
    return out


def _records(chains, rid="r0"):
    """Trace records as the hook writes them: per cycle one EXTEND / DRAFT_EXTEND_V2 row, then STEPS - 1 DECODE."""
    recs, n = [], 0
    for ci, (p, chain) in enumerate(chains.items()):
        for s, (pos, inp, top, topd) in enumerate(chain):
            mode = ("EXTEND" if ci == 0 else "DRAFT_EXTEND_V2") if s == 0 else "DECODE"
            recs.append({"forward": n, "mode": mode, "rids": [rid], "positions": torch.tensor([pos]),
                         "input_ids": torch.tensor([inp]), "topk": torch.tensor([[top, top + 1]]),
                         "topk_draft": torch.tensor([[topd, (topd + 1) % 2048]]), "row_req": torch.tensor([0])})
            n += 1
    return recs


def test_the_checkpoints_own_proposals_match_at_every_step(draft, seq):
    chains = _offline_cycles(draft, seq, [9, 11, 14])
    res = compare_request(draft, seq, request_cycles(_records(chains))["r0"])
    assert res["compared"] == {1: 3, 2: 3, 3: 3} and res["diverged"] == {} and res["first"] is None
    assert all(r["gap"] == 0.0 for r in res["rows"])


def _damaged(chains, p, step, **change):
    chains = {k: list(v) for k, v in chains.items()}
    pos, inp, top, topd = chains[p][step - 1]
    if "top" in change:                           # another proposal (draft id and its target id)
        top, topd = change["top"], (topd + 7) % 2048
    pos = change.get("position", pos)
    inp = change.get("input", inp)
    chains[p][step - 1] = (pos, inp, top, topd)
    if step < STEPS and "top" in change:          # the next step's served input is the served proposal
        q = chains[p][step]
        chains[p][step] = (q[0], top, q[2], q[3])
    return chains


def test_a_step_1_divergence_names_the_served_draft(draft, seq):
    chains = _offline_cycles(draft, seq, [9, 11, 14])
    bad = _damaged(chains, 11, 1, top=5)
    res = compare_request(draft, seq, request_cycles(_records(bad))["r0"])
    assert res["first"]["step"] == 1 and res["first"]["position"] == 11 and res["first"]["cycle"] == 1
    assert res["first"]["served"] == 5 and res["first"]["offline"] == chains[11][0][2]
    assert res["diverged"].get(1) == 1 and res["first"]["gap"] > 0
    assert mechanism([res["first"]["step"]]) == "served_draft_differs"


def test_a_divergence_only_from_step_2_names_the_drafts_kv(draft, seq):
    chains = _offline_cycles(draft, seq, [9, 11, 14])
    bad = _damaged(chains, 14, 2, top=6)
    res = compare_request(draft, seq, request_cycles(_records(bad))["r0"])
    # step 1 holds; step 3 is replayed on the served (changed) step-2 token, which the unchanged served step 3 was not
    # computed from
    assert 1 not in res["diverged"] and res["diverged"][2] == 1, res["diverged"]
    assert res["first"]["step"] == 2 and res["first"]["position"] == 15
    assert mechanism([None, res["first"]["step"]]) == "draft_kv_diverges"


def test_a_wrong_position_or_input_is_a_divergence_saying_so(draft, seq):
    chains = _offline_cycles(draft, seq, [9, 11])
    res = compare_request(draft, seq, request_cycles(_records(_damaged(chains, 9, 3, position=30)))["r0"])
    assert res["first"]["step"] == 3 and "position 30, expected 11" in res["first"]["why"]
    res = compare_request(draft, seq, request_cycles(_records(_damaged(chains, 11, 1, input=3)))["r0"])
    assert res["first"]["step"] == 1 and f"input token 3, expected {int(seq.tokens[12])}" in res["first"]["why"]


def test_first_divergence_is_the_lowest_step_then_the_earliest_cycle():
    rows = [{"cycle": 0, "step": 3, "match": False}, {"cycle": 2, "step": 1, "match": False},
            {"cycle": 1, "step": 1, "match": False}, {"cycle": 0, "step": 1, "match": True}]
    assert first_divergence(rows) == {"cycle": 1, "step": 1, "match": False}
    assert first_divergence([{"cycle": 0, "step": 1, "match": True}]) is None
    assert mechanism([None, None]) is None and mechanism([3, 2]) == "draft_kv_diverges"
    assert mechanism([3, 1]) == "served_draft_differs"


def test_cycles_of_two_requests_in_one_batch_and_a_tree_step():
    def rec(mode, rids, pos, req):
        n = len(pos)
        return {"forward": 0, "mode": mode, "rids": rids, "positions": torch.tensor(pos),
                "input_ids": torch.ones(n, dtype=torch.long),
                "topk": torch.zeros(n, 1, dtype=torch.long), "topk_draft": torch.zeros(n, 1, dtype=torch.long),
                "row_req": torch.tensor(req)}
    recs = [rec("DECODE", ["a"], [4], [0]),                      # before any extend of its request: dropped
            rec("EXTEND", ["a", "b"], [5, 8], [0, 1]), rec("DECODE", ["a", "b"], [6, 9], [0, 1]),
            rec("DRAFT_EXTEND_V2", ["a", "b"], [7, 10], [0, 1]), rec("DECODE", ["a", "b", "b"], [8, 11, 11], [0, 1, 1])]
    cyc = request_cycles(recs)
    assert [[s.position for s in c.steps] for c in cyc["a"]] == [[5, 6], [7, 8]]
    assert [[s.step for s in c.steps] for c in cyc["b"]] == [[1, 2], [1, 2]]
    assert cyc["b"][1].tree and not cyc["a"][1].tree


# --------------------------------------------------------------------------- the hook on fake SGLang calls
def _fb(mode, positions, bs, **kw):
    return SimpleNamespace(forward_mode=SimpleNamespace(name=mode), positions=torch.tensor(positions),
                           batch_size=bs, seq_lens=torch.tensor(kw.pop("seq_lens", [0] * bs)),
                           req_pool_indices=torch.arange(bs), rids=[f"q{i}" for i in range(bs)], **kw)


def _mod(arch):
    return SimpleNamespace(config=SimpleNamespace(architectures=[arch]))


def test_the_hook_records_the_proposing_rows_in_target_ids(tmp_path):
    d2t_dir = tmp_path / "draft"
    d2t_dir.mkdir()
    d2t = torch.tensor([0, 10, 20, 30])                           # draft id i -> target id i + d2t[i]
    save_file({"d2t": d2t}, str(d2t_dir / "model.safetensors"))
    out = tmp_path / "trace"
    hook = draft_trace_factory({"out_dir": str(out), "topk": 2, "draft_dir": str(d2t_dir)})
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [5.0, 0.0, 0.0, 9.0]])
    ids = torch.tensor([7, 8, 9, 11, 12])
    fb = _fb("EXTEND", [0, 1, 2, 0, 1], 2, extend_seq_lens=torch.tensor([3, 2]))
    hook(_mod("LlamaForCausalLMEagle3"), (ids, None, None, fb), SimpleNamespace(next_token_logits=logits))
    assert not out.exists()                                       # not armed: nothing written
    out.mkdir()
    (out / ARM_FILE).write_text("")
    hook(_mod("LlamaForCausalLM"), (ids, None, None, fb), SimpleNamespace(next_token_logits=logits))  # the target
    assert trace_counts(out) == {}
    hook(_mod("LlamaForCausalLMEagle3"), (ids, None, None, fb), SimpleNamespace(next_token_logits=logits))
    # DRAFT_EXTEND_V2: 3 rows per request, the row accept_len - 1 proposes
    logits2 = torch.arange(24, dtype=torch.float32).reshape(6, 4) % 5
    fb2 = _fb("DRAFT_EXTEND_V2", [3, 4, 5, 2, 3, 4], 2, spec_info=SimpleNamespace(num_accept_tokens=torch.tensor([2, 1])))
    hook(_mod("LlamaForCausalLMEagle3"), (torch.arange(6), None, None, fb2), SimpleNamespace(next_token_logits=logits2))
    recs = read_trace(out)
    assert [r["mode"] for r in recs] == ["EXTEND", "DRAFT_EXTEND_V2"] and recs[0]["rids"] == ["q0", "q1"]
    assert recs[0]["positions"].tolist() == [2, 1] and recs[0]["input_ids"].tolist() == [9, 12]
    assert recs[0]["topk_draft"].tolist() == [[1, 3], [3, 0]]
    assert recs[0]["topk"].tolist() == [[11, 33], [33, 0]]
    # rows 1 (request 0, accept 2) and 3 (request 1, accept 1)
    assert recs[1]["positions"].tolist() == [4, 2] and recs[1]["input_ids"].tolist() == [1, 3]
    assert recs[1]["topk_draft"][:, 0].tolist() == [int(logits2[1].argmax()), int(logits2[3].argmax())]
    assert json.loads((out / "rank0" / "index.jsonl").read_text().splitlines()[0])["file"] == "trace000000.safetensors"
    assert set(load_file(str(out / "rank0" / "trace000001.safetensors"))) >= {"topk", "positions", "row_req"}
    # an error while recording never reaches the server: said once in ERROR, then the hook stays off
    broken = SimpleNamespace(forward_mode=SimpleNamespace(name="DECODE"))          # no positions
    assert hook(_mod("LlamaForCausalLMEagle3"), (ids, None, None, broken), SimpleNamespace(next_token_logits=logits)) \
        is None
    assert "AttributeError" in (out / "ERROR").read_text()
    hook(_mod("LlamaForCausalLMEagle3"), (ids, None, None, fb), SimpleNamespace(next_token_logits=logits))
    assert trace_counts(out) == {0: 2}


def test_the_probe_finds_the_trace_folder_or_says_how_to_start_it(tmp_path):
    assert ATTACH_TRACE_FACTORY == TRACE_FACTORY
    spec = trace_hook_specs(tmp_path / "t", REFERENCE_DRAFT)
    assert spec[0]["hook_factory"] == TRACE_FACTORY and spec[0]["target_modules"] == ["logits_processor"]
    assert trace_dir({"forward_hooks": spec}) == (tmp_path / "t").resolve()
    ctx = SimpleNamespace(client=SimpleNamespace(server_info=lambda: {"forward_hooks": []}), adapter=SGLangAdapter(),
                          att=SimpleNamespace(draft_dir=REFERENCE_DRAFT), max_new_tokens=8)
    assert _applies(ctx) == HOW and "--trace-draft DIR" in HOW
    no_ext = SimpleNamespace(describe=lambda required: (_ for _ in ()).throw(RequestRejected("no worker extension")))
    assert "worker extension: no worker extension" in _applies(SimpleNamespace(**{**vars(ctx), "client": no_ext,
                                                                                    "adapter": VLLMAdapter()}))
    ctx.client = SimpleNamespace(server_info=lambda: {"forward_hooks": spec})
    assert "not readable on this machine" in _applies(ctx)
    (tmp_path / "t").mkdir()
    assert _applies(ctx) is None
    ctx.att = SimpleNamespace(draft_dir=None)
    assert "--draft" in _applies(ctx)


def test_untraced_requests_are_listed(draft, seq):
    res = compare_trace(draft, [seq], [])
    assert res["untraced"] == ["r0"] and res["requests"] == [] and res["mechanism"] is None


def test_server_hook_specs_add_the_trace_and_nothing_else_for_it(tmp_path):
    from helpers.capture import server_hook_specs

    assert server_hook_specs(8) is None
    specs = server_hook_specs(8, trace_dir=tmp_path / "t", draft_dir=REFERENCE_DRAFT)
    assert [s["name"] for s in specs] == ["e3f-trace-draft"]
    assert specs[0]["config"]["draft_dir"] == str(REFERENCE_DRAFT.resolve())
    both = server_hook_specs(8, rank_capture_dir=tmp_path / "r", trace_dir=tmp_path / "t")
    assert both[-1]["name"] == "e3f-trace-draft" and any(s["name"] == "e3f-capture" for s in both)


def test_a_trace_of_target_ids_only_compares_as_one_with_draft_ids(draft, seq):
    """vLLM's trace carries the proposals as target ids only (``topk_draft`` -1): the comparison maps them into the
    draft's vocabulary and decides exactly as with the hook's draft ids, and a served id outside the draft's
    vocabulary diverges."""
    chains = _offline_cycles(draft, seq, [9, 11, 14])
    bad = _damaged(chains, 11, 1, top=int(draft.to_target_ids(torch.tensor(5))))

    def target_only(recs):
        return [{**r, "topk_draft": torch.full_like(r["topk_draft"], -1)} for r in recs]
    for c in (chains, bad):
        a = compare_request(draft, seq, request_cycles(_records(c))["r0"])
        b = compare_request(draft, seq, request_cycles(target_only(_records(c)))["r0"])
        assert [(r["step"], r["match"], r["served"]) for r in a["rows"]] == \
               [(r["step"], r["match"], r["served"]) for r in b["rows"]]
    assert draft.to_draft_id(int(draft.to_target_ids(torch.tensor(5)))) == 5
    outside = next(t for t in range(draft.arch.vocab) if draft.to_draft_id(t) < 0) if draft.hot_token_id is not None \
        else None
    if outside is not None:
        far = _damaged(chains, 9, 1, top=outside)
        res = compare_request(draft, seq, request_cycles(target_only(_records(far)))["r0"])
        assert res["first"]["step"] == 1 and res["first"]["gap"] is None and not res["first"]["match"]


def test_records_built_in_memory_are_checked_too(draft, seq):
    """Records that never went through read_trace (the vLLM worker's, built in memory) are checked as the hook's
    files are (helpers.draft.trace.check_record): a row_req of -1 was read as the last rid (the request compared as
    if it were traced), a [1, 0] top-k crashed with IndexError, a missing row_req with KeyError."""
    recs = _records(_offline_cycles(draft, seq, [9, 11]))
    assert request_cycles(recs)["r0"][0].steps[0].position == 9
    for name, value, says in [("row_req", torch.tensor([-1]), "request index -1 is outside 0 .. 0"),
                              ("topk", torch.zeros(1, 0, dtype=torch.long), "no top-k column"),
                              ("row_req", None, "missing")]:
        bad = [dict(r) for r in recs]
        if value is None:
            bad[2].pop(name)
        else:
            bad[2][name] = value
        with pytest.raises(BadInput, match=says) as e:
            compare_trace(draft, [seq], bad)
        assert str(e.value).startswith(f"[{name}]: forward 2: ")
