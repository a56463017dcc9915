"""The current-token hypothesis of the draft step trace (:func:`helpers.draft.trace.current_token_replay`) on the
committed NextN head (the Kimi-class target's ``model.layers.8.*``, :func:`helpers.draft.loader.load_draft`) and the
target's own states: a trace whose step-1 proposals are the head's own with the draft-extend ids un-rotated (every
row, or the traced rows and a share of the others) is named ``draft_extend_ids_unshifted``; a clean trace and the
trace of a head with damaged weights (right ids) are not."""
from __future__ import annotations

import copy

import pytest
import torch

from helpers.draft.simulate import SimSequence
from helpers.draft.trace import compare_trace, current_token_replay
from support import ROOT

TARGET = ROOT / "env" / "models" / "kimi" / "target"
SAMPLE = ROOT / "env" / "models" / "kimi" / "data" / "sample"
T, START = 48, 16


@pytest.fixture(scope="module")
def world():
    from transformers import AutoModelForCausalLM

    from helpers.draft.loader import load_draft
    if not (TARGET / "nextn_training_log.json").is_file():
        pytest.skip("the Kimi-class target's NextN head is not built here")
    model = AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()
    seqs = []
    for i in range(2):
        ids = torch.load(SAMPLE / "rows_0-2000" / f"data_{i}.ckpt", weights_only=True)["input_ids"].reshape(-1)[:T]
        with torch.no_grad():
            h = model.model(input_ids=ids[None]).last_hidden_state[0]
        seqs.append(SimSequence(f"r{i}", ids.long(), h[: T - 1].clone(), START))
    return load_draft(TARGET, TARGET), seqs


#: the traced draft-extend rows: the prompt's last position, then one per verify cycle
ROWS = list(range(START - 1, T - 1, 2))


def _records(head, seq, ids: torch.Tensor):
    """Step-1 trace records (one EXTEND, then DRAFT_EXTEND_V2 rows) whose proposals are ``head``'s on ``seq``'s
    states with the draft-extend ids ``ids`` (``[T - 1]``; the right ones are ``tokens[1:]``); the recorded input id
    is the right one (the outer model's ids, as the trace hook sees them)."""
    with torch.no_grad():
        ext = head.extend(ids, seq.aux)
    recs = []
    for n, p in enumerate(ROWS):
        d = int(ext.logits[p].argmax())
        top = int(head.to_target_ids(torch.tensor(d)))
        recs.append({"forward": n, "mode": "EXTEND" if n == 0 else "DRAFT_EXTEND_V2", "rids": [seq.key],
                     "positions": torch.tensor([p]), "input_ids": torch.tensor([int(seq.tokens[p + 1])]),
                     "topk": torch.tensor([[top, top + 1]]), "topk_draft": torch.tensor([[d, d + 1]]),
                     "row_req": torch.tensor([0])})
    return recs


def _trace(head, seqs, ids_of):
    recs, n = [], 0
    for s in seqs:
        for r in _records(head, s, ids_of(s)):
            recs.append(r | {"forward": n})
            n += 1
    return recs


def _shift_some(s: SimSequence, share: float, seed: int) -> torch.Tensor:
    ids = s.tokens[1:].clone()
    g = torch.Generator().manual_seed(seed)
    hit = torch.rand(T - 1, generator=g) < share
    hit[ROWS] = True                               # the traced rows hit (the ones that diverge)
    ids[hit] = s.tokens[:-1][hit]
    return ids


def test_shifted_ids_are_named_with_the_rows_they_explain(world):
    head, seqs = world
    for ids_of in (lambda s: s.tokens[:-1], lambda s: _shift_some(s, 0.3, 1)):
        res = compare_trace(head, seqs, _trace(head, seqs, ids_of))
        ct = res["current_token"]
        assert res["mechanism"] == "served_draft_differs"
        div = sum(r["diverged"].get(1, 0) for r in res["requests"])
        assert ct["diverging"] == div >= 10, (ct, div)        # most traced rows change their proposal
        assert ct["named"] and ct["explained"] >= 0.9 * ct["diverging"] and ct["right_ids"] == 0, ct


def test_a_clean_trace_and_damaged_weights_are_not_named(world):
    head, seqs = world
    clean = compare_trace(head, seqs, _trace(head, seqs, lambda s: s.tokens[1:]))
    assert clean["mechanism"] is None and not clean["current_token"]["named"]
    assert clean["current_token"]["diverging"] == 0
    bad = copy.copy(head)                          # the head with noise on eh_proj (its other tensors shared)
    bad.w = dict(head.w)
    w = head.w["eh_proj.weight"]
    g = torch.Generator().manual_seed(3)
    bad.w["eh_proj.weight"] = w + torch.randn(w.shape, generator=g).to(w.dtype) * w.float().pow(2).mean().sqrt() * 0.8
    res = compare_trace(head, seqs, _trace(bad, seqs, lambda s: s.tokens[1:]))
    ct = res["current_token"]
    assert res["mechanism"] == "served_draft_differs" and ct["diverging"] >= 5, ct
    assert not ct["named"] and ct["explained"] < 0.5 * ct["diverging"], ct


def test_a_row_outside_the_sequence_is_refused(world):
    head, seqs = world
    with pytest.raises(ValueError, match="outside 0 .. 46"):
        current_token_replay(head, seqs[0].tokens, seqs[0].aux, [{"position": T - 1, "served": 0}])


# ------------------------------------------------------------------ the fault fixture itself (no SGLang needed)
def _module(where: str, seen: list):
    """A stand-in of an inner ``model`` whose class lives in ``where`` (``..deepseek_nextn``: the draft), recording
    the ids each forward gets."""
    def forward(self, ids, positions, fb):
        seen.append(ids.tolist())
        return ids.clone()
    cls = type("Inner", (torch.nn.Module,), {"forward": forward, "__module__": where})
    m = cls()
    m.embed_tokens = torch.nn.Embedding(50, 2)
    return m


def _fb(mode: str, reqs: list[int], lens: list[int] | None):
    from types import SimpleNamespace
    return SimpleNamespace(forward_mode=SimpleNamespace(name=mode), req_pool_indices=torch.tensor(reqs),
                           extend_seq_lens=None if lens is None else torch.tensor(lens))


def test_the_fault_feeds_each_draft_extend_row_its_current_token(tmp_path):
    import json

    from support import engine_faults as ef
    ef._KNOWN.clear()
    arm = tmp_path / "ARM"
    hook = ef.factory({"fault": "embed_current_token", "strength": 1.0, "seed": 0, "arm": str(arm)})
    seen: list = []
    target, draft = _module("x.models.deepseek_v2", seen), _module("x.models.deepseek_nextn", seen)
    x = [7, 11, 13, 17, 19, 23, 29, 31]
    # the prefill: the target's extend over x0..x4, the draft's over the rotated ids x1..x5 (tail: the next token)
    hook(target, (torch.tensor(x[:5]), torch.arange(5), _fb("EXTEND", [3], [5])), None)
    args = (torch.tensor(x[1:6]), torch.arange(5), _fb("EXTEND", [3], [5]))
    assert hook(draft, args, None) is None                      # unarmed: untouched
    arm.write_text(json.dumps({"strength": 1.0, "seed": 0}))
    assert hook(draft, args, None).tolist() == x[:5]           # every row its current token, row 0 the target's x0
    # a verify (x5 and the draft token 40) then the draft extend of the tokens verification emitted (x6, x7)
    hook(target, (torch.tensor([x[5], 40]), torch.tensor([5, 6]), _fb("TARGET_VERIFY", [3], None)), None)
    out = hook(draft, (torch.tensor(x[6:8]), torch.tensor([5, 6]), _fb("DRAFT_EXTEND_V2", [3], [2])), None)
    assert out.tolist() == [x[5], x[6]]
    # a request the target never showed: its first row gets a seeded wrong id, the others their current token
    out = hook(draft, (torch.tensor([2, 3, 4]), torch.tensor([0, 1, 2]), _fb("EXTEND", [9], [3])), None)
    assert out[0].item() == ef.wrong_id(0, 0, 50, 2) and out[1:].tolist() == [2, 3]
    # a share: the rows pick() hits, no others
    arm.write_text(json.dumps({"strength": 0.4, "seed": 5}))
    ids = torch.tensor(x[1:6])
    out = hook(draft, (ids, torch.arange(5), _fb("EXTEND", [3], [5])), None)
    hit = [ef.pick(p, 5, 0.4) for p in range(5)]
    assert out.tolist() == [x[p] if h else x[p + 1] for p, h in enumerate(hit)] and 0 < sum(hit) < 5


def test_the_step_trace_probe_is_undecided_when_no_traced_row_lies_inside_the_served_states(world, tmp_path):
    """The step-trace probe's decision (helpers.investigation.probes.trace._result) on the committed head's own
    proposals: rows inside the served states are compared and cleared; the same trace moved past the states (rows
    T - 1 .., as the draft runs after the last verify) compares 0 rows, which used to say ``clear`` ("0 draft steps
    ... equal the checkpoint's"): it is ``undecided``, saying why."""
    from types import SimpleNamespace
    from helpers.investigation.probes.trace import STEP_TRACE, _result
    head, seqs = world

    def ctx(name):
        run = tmp_path / name
        run.mkdir()
        return SimpleNamespace(run_dir=run, folder=lambda p: (run / p).mkdir(exist_ok=True) or run / p)
    recs = _trace(head, seqs, lambda s: s.tokens[1:])
    inside = compare_trace(head, seqs, recs)
    inside["prompt_ids"] = {s.key: s.key for s in seqs}
    n = sum(sum(r["compared"].values()) for r in inside["requests"])
    assert n == 2 * len(ROWS)
    res = _result(STEP_TRACE, ctx("inside"), inside, "two sample rows")
    assert res.decision == "clear" and res.why == f"{n} draft steps of 2 request(s) equal the checkpoint's"
    past = [r | {"positions": r["positions"] + T} for r in recs]
    out = compare_trace(head, seqs, past)
    out["prompt_ids"] = {s.key: s.key for s in seqs}
    assert out["mechanism"] is None and all(r["compared"] == {} for r in out["requests"])
    res = _result(STEP_TRACE, ctx("past"), out, "two sample rows")
    assert res.decision == "undecided" and res.why.startswith(
        f"no traced draft step could be compared: the {2 * len(ROWS)} traced cycle(s) of 2 request(s)"), res.why
