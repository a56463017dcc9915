"""The engine-fault generator (tests/support/engine_faults.py: classes x seeds x strengths for
bench/bench_engine_state.py) and the chunk-boundary hook on a stand-in draft model: seeded, every class reachable,
strengths in their tier, the boundary rows only; the sampled_verify class (tests/support/verify_faults.py on for the
server's life) and its arm rule."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from helpers.investigation.probes import PROBES
from helpers.kinds import FINDING_KINDS
from support.engine_faults import (CLASSES, DECAY_AFTER, EXPECTED, FAULTS, PENDING, STRENGTH, boundary_rows, draw,
                                   draws, factory, named, pick, spec)
from support.verify_faults import armed_strength


def test_same_seed_same_cases_and_another_seed_other_cases():
    a, b = draws(13, seed=4), draws(13, seed=4)
    assert [x.to_json() for x in a] == [x.to_json() for x in b]
    c = draws(13, seed=5)
    assert [x.to_json() for x in a] != [x.to_json() for x in c]
    assert [x.cls for x in a[:3]] == ["clean"] * 3 and len({x.seed for x in a[:3]}) == 3


def test_every_class_and_both_tiers_are_reached_with_strengths_in_their_range():
    n = 3 + 2 * len(FAULTS)
    cases = draws(n, seed=0)
    assert {x.cls for x in cases} == set(CLASSES)
    for cls in FAULTS:
        tiers = {x.tier for x in cases if x.cls == cls}
        assert tiers == {"strong", "weak"}, (cls, tiers)
    for x in cases:
        if x.cls == "clean":
            assert x.expected is None and x.hook_specs() == []
            continue
        lo, hi = STRENGTH[x.cls][0 if x.tier == "strong" else 1]
        assert lo <= x.strength <= hi, x
        assert x.expected == EXPECTED[x.cls][0]
        if x.cls == "draft_decay":
            assert DECAY_AFTER[0] <= x.after <= DECAY_AFTER[1]
    # a second seed's draws in one class spread over the range (a seeded draw, not a constant)
    s = {draw(k, "chunk_boundary_token").strength for k in range(20)}
    assert len(s) > 10 and min(s) < 0.7 and max(s) > 0.9


def test_hook_specs_name_the_factory_of_each_class_and_are_json():
    by = {x.cls: x.hook_specs() for x in draws(3 + len(FAULTS), seed=2)}
    assert json.loads(json.dumps(by)) == by
    assert [h["hook_factory"].split(":")[1] for h in by["draft_decay"]] == ["scaled_weights_factory"] * 2
    decay = by["draft_decay"][1]["config"]
    assert decay["arm"] is None and decay["mode"] == "count"
    assert by["kv_wrong_slot"][0]["target_modules"] == ["model.layers.0.self_attn.attn"]
    assert by["chunk_boundary_token"][0]["config"]["fault"] == "chunk_boundary_token"
    # sampled_verify: the verify_faults fixture on for the server's whole life (arm None), the drawn share and seed
    sv = [x for x in draws(3 + len(FAULTS), seed=2) if x.cls == "sampled_verify"][0]
    (h,) = by["sampled_verify"]
    assert h["hook_factory"] == "tests.support.verify_faults:factory" and h["target_modules"] == ["logits_processor"]
    assert h["config"] == {"arm": None, "strength": sv.strength, "seed": sv.seed}
    assert sv.tier == "strong" and STRENGTH["sampled_verify"][0][0] <= sv.strength <= STRENGTH["sampled_verify"][0][1]


def test_every_class_names_a_declared_finding_and_real_probes():
    probes = {p.name for p in PROBES}
    for cls, (kind, mech) in EXPECTED.items():
        assert kind is None or kind in FINDING_KINDS, cls
        assert set(mech) <= probes, (cls, mech)
    assert EXPECTED["sampled_verify"] == ("sampled_verify_loses_acceptance", ("sampled_verify",))
    # the strong tier cuts more rows than the weak one, and neither range is empty or outside (0, 1]
    (slo, shi), (wlo, whi) = STRENGTH["sampled_verify"]
    assert 0 < wlo < whi < slo < shi <= 1


def test_sampled_verify_is_drawn_in_both_tiers_with_seeded_strengths():
    s = draw(11, "sampled_verify", "strong")
    w = draw(11, "sampled_verify", "weak")
    assert s.expected == w.expected == "sampled_verify_loses_acceptance"
    assert s == draw(11, "sampled_verify", "strong") and s.seed == w.seed and s.strength > w.strength
    strong = {draw(k, "sampled_verify").strength for k in range(20)}
    lo, hi = STRENGTH["sampled_verify"][0]
    assert len(strong) > 10 and all(lo <= x <= hi for x in strong)


def test_the_sampled_verify_fixture_is_off_without_its_file_and_always_on_without_one(tmp_path):
    arm = tmp_path / "ARM"
    assert armed_strength(None, 0.4) == 0.4                 # the generated class: on for the server's life
    assert armed_strength(str(arm), 0.4) is None            # off by default: no file
    arm.write_text("armed\n")
    assert armed_strength(str(arm), 0.4) == 0.4             # a file without a number: the spec's strength
    arm.write_text("0.05\n")
    assert armed_strength(str(arm), 0.4) == 0.05            # a number: that share (a sweep on one server)
    arm.write_text("1.5")
    with pytest.raises(ValueError, match="ARM: expected a share of rows in \\[0, 1\\]"):
        armed_strength(str(arm), 0.4)


def test_pending_and_unknown_classes_are_refused_by_name(monkeypatch):
    assert PENDING == {} and "sampled_verify" in CLASSES
    monkeypatch.setitem(PENDING, "later_class", "tests/support/later.py (a fault not written yet)")
    with pytest.raises(ValueError, match="'later_class' is not available yet: tests/support/later.py"):
        draw(1, "later_class")
    with pytest.raises(ValueError, match="unknown engine fault class 'nope'"):
        draw(1, "nope")
    with pytest.raises(ValueError, match="unknown tier"):
        draw(1, "verify_swap", "medium")


def test_pick_hits_the_share_it_is_given_and_the_same_rows_each_time():
    for s in (0.05, 0.3, 0.9):
        hits = [pick(p, 7, s) for p in range(20000)]
        assert abs(sum(hits) / len(hits) - s) < 0.02, s
        assert hits == [pick(p, 7, s) for p in range(20000)]
    assert not any(pick(p, 7, 0.0) for p in range(1000)) and all(pick(p, 7, 1.0) for p in range(1000))


def test_boundary_rows_are_later_chunks_first_rows_only():
    # three requests in one extend: a first chunk (prefix 0), a later chunk (prefix 8 = one 8-token chunk), and a
    # prefix-cache hit of 5 tokens (no multiple of 8): only the later chunk's first row, flat row 8
    assert boundary_rows([0, 8, 5], [8, 8, 4], 8, strength=1.0, seed=3) == [(8, 1)]
    assert boundary_rows([0, 16, 8], [8, 3, 8], 8, strength=1.0, seed=3) == [(8, 1), (11, 1)]
    assert boundary_rows([0, 8, 5], [8, 8, 4], None, strength=1.0, seed=3) == [(8, 1), (16, 1)]   # size unknown
    assert boundary_rows([0, 8, 16], [8, 8, 8], 8, strength=0.0, seed=3) == []
    # span: that many rows from the boundary, 0 the whole later chunk
    assert boundary_rows([0, 16, 8], [8, 3, 8], 8, strength=1.0, seed=3, span=0) == [(8, 3), (11, 8)]
    assert boundary_rows([0, 16, 8], [8, 3, 8], 8, strength=1.0, seed=3, span=5) == [(8, 3), (11, 5)]


class _Draft(torch.nn.Module):
    """A stand-in for SGLang's EAGLE-3 draft ``LlamaModel``: forward(input_ids, positions, forward_batch,
    input_embeds) -> the embeddings of its ids (the hook picks the draft by the class's module name)."""

    def __init__(self):
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(50, 4)
        self.calls = 0

    def forward(self, input_ids, positions, forward_batch, input_embeds=None):
        self.calls += 1
        return self.embed_tokens(input_ids)


_Draft.__module__ = "sglang.srt.models.llama_eagle3"


def _fb(prefix, lens, mode="EXTEND"):
    return SimpleNamespace(forward_mode=SimpleNamespace(name=mode), extend_prefix_lens=torch.tensor(prefix),
                           extend_seq_lens=torch.tensor(lens))


def test_chunk_boundary_hook_changes_the_boundary_row_only_and_leaves_cold_requests_alone():
    torch.manual_seed(0)
    m = _Draft()
    m.register_forward_hook(factory(spec("chunk_boundary_token", strength=1.0, seed=9)["config"]))
    ids = torch.arange(1, 17)
    # cold, unchunked: prefix 0, untouched (one forward, the clean output)
    out = m(ids[:8], torch.arange(8), _fb([0], [8]))
    assert m.calls == 1 and torch.equal(out, m.embed_tokens(ids[:8]))
    # a later chunk of 8 after a first of 8: the hook re-runs the forward with row 0's id replaced
    pos = torch.arange(8, 16)
    out = m(ids[8:], pos, _fb([8], [8]))
    assert m.calls == 3
    clean = m.embed_tokens(ids[8:])
    assert not torch.equal(out[0], clean[0]) and torch.equal(out[1:], clean[1:])
    # the whole chunk (span 0): every row takes the id one position early (the shift lost), the first a wrong id
    w = _Draft()
    w.register_forward_hook(factory(spec("chunk_boundary_token", strength=1.0, seed=9, span=0)["config"]))
    fed, forward = [], w.forward
    w.forward = lambda ids_, *a: (fed.append(ids_.clone()), forward(ids_, *a))[1]   # the ids each forward gets
    w(ids[8:], pos, _fb([8], [8]))
    assert len(fed) == 2 and torch.equal(fed[0], ids[8:])
    assert torch.equal(fed[1][1:], ids[8:15]) and fed[1][0] != ids[8]
    # not an extend (a draft decode step): untouched
    out = m(ids[8:9], pos[:1], _fb([8], [1], mode="DECODE"))
    assert m.calls == 4 and torch.equal(out, m.embed_tokens(ids[8:9]))


def test_named_reads_findings_then_failures_then_undecided():
    ok = {"status": "ran", "decision": "clear", "findings": []}
    assert named([ok, {"status": "skipped", "decision": None}]) == "ok"
    assert named([ok, {"status": "ran", "decision": "undecided", "findings": []}]) == "undecided"
    assert named([ok, {"status": "failed", "decision": None}]) == "failed"
    two = [{"status": "ran", "decision": "counts", "findings": [{"kind": "draft_kv_diverges"}]},
           {"status": "ran", "decision": "counts", "findings": [{"kind": "cache_state_loses_acceptance"}]}]
    assert named(two) == "cache_state_loses_acceptance+draft_kv_diverges"
