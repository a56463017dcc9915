"""The draft-state engine faults' module choice (tests/support/engine_faults.py: kv_wrong_slot, draft_decay) by
what the draft is, on the module names SGLang 0.5.23 really registers (tests/data/sglang_modules/: every module of
the target's and the draft's model runner, from a live ``--forward-hooks`` spec on ``*``), and the two hooks on an
MLA-shaped pool and a NextN head's ``eh_proj`` with real tensors. No server."""
from __future__ import annotations

import fnmatch
import json
import sys
from types import ModuleType, SimpleNamespace

import pytest
import torch

from support import ROOT
from support.engine_faults import (_STATE, DRAFT_MODULES, draft_kind, draft_modules, draw, draws, kv_wrong_slot_factory,
                                   scaled_weights_factory, specs)

MODULES = ROOT / "tests" / "data" / "sglang_modules"


def _served(kind: str) -> dict:
    return json.loads((MODULES / f"{kind}.json").read_text())


def _matches(pattern: str, names: list[str]) -> list[str]:
    return [n for n in names if fnmatch.fnmatch(n, pattern)]        # hook_manager.register_forward_hooks' rule


@pytest.mark.parametrize("kind", ["eagle3", "nextn"])
def test_each_drafts_patterns_hit_one_real_module_of_its_draft(kind):
    doc = _served(kind)
    assert draft_kind([doc["draft_type"]]) == kind == doc["draft_kind"]
    mods = draft_modules(kind)
    for role, pattern in mods.items():
        assert _matches(pattern, doc["draft"]) == [pattern], (kind, role)
    # the weights linear is the draft's alone: no module of the target matches it
    assert _matches(mods["weights"], doc["target"]) == []
    # the attention: the NextN head's is the draft's alone (the target's layers are model.layers.N); the EAGLE-3
    # draft's name is also the Llama target's layer-0 attention, which the hook leaves alone by its own test (a
    # DECODE forward with spec_info: the target of a speculative server verifies, never decodes)
    expect = ["model.layers.0.self_attn.attn"] if kind == "eagle3" else []
    assert _matches(mods["attn"], doc["target"]) == expect
    # and the other kind's patterns miss this draft (the choice matters)
    other = draft_modules("nextn" if kind == "eagle3" else "eagle3")
    assert all(_matches(p, doc["draft"]) == [] for p in other.values())


def test_the_nextn_heads_mla_attention_is_attn_mqa_beside_its_prefill_only_attn_mha():
    names = _served("nextn")["draft"]
    assert sorted(_matches("model.decoder.self_attn.attn_*", names)) == ["model.decoder.self_attn.attn_mha",
                                                                          "model.decoder.self_attn.attn_mqa"]
    assert DRAFT_MODULES["nextn"]["attn"].endswith("attn_mqa") and "model.fc" not in names


def test_eagle3_specs_are_unchanged_and_nextn_specs_name_the_heads_modules(tmp_path):
    e = {x.cls: x.hook_specs() for x in draws(9, seed=2)}
    n = {x.cls: x.hook_specs() for x in draws(9, seed=2, draft="nextn")}
    assert e["kv_wrong_slot"][0]["target_modules"] == ["model.layers.0.self_attn.attn"]
    assert e["draft_decay"][0]["target_modules"] == ["model.fc"]
    assert n["kv_wrong_slot"][0]["target_modules"] == ["model.decoder.self_attn.attn_mqa"]
    assert n["draft_decay"][0]["target_modules"] == ["model.eh_proj"]
    for cls in e:                                     # the same draws, only the module names differ
        if cls not in ("kv_wrong_slot", "draft_decay"):
            assert e[cls] == n[cls], cls
        else:
            assert [h["config"] for h in e[cls]] == [h["config"] for h in n[cls]]
    a, b = draw(7, "draft_decay", "weak"), draw(7, "draft_decay", "weak", draft="nextn")
    assert (a.strength, a.after, a.seed) == (b.strength, b.after, b.seed) and (a.draft, b.draft) == ("eagle3", "nextn")
    sp, _, _ = specs(str(tmp_path), draft="nextn")
    assert [s["target_modules"][0] for s in sp] == ["model.eh_proj", "logits_processor",
                                                    "model.decoder.self_attn.attn_mqa"]
    assert [s["target_modules"][0] for s in specs(str(tmp_path))[0]] == ["model.fc", "logits_processor",
                                                                        "model.layers.0.self_attn.attn"]


def test_unknown_drafts_are_refused_by_name():
    with pytest.raises(ValueError, match=r"draft architectures \['LlamaForCausalLMEagle'\]: expected one of "
                                         "LlamaForCausalLMEagle3, DeepseekV3ForCausalLMNextN"):
        draft_kind(["LlamaForCausalLMEagle"])
    with pytest.raises(ValueError, match="draft architectures"):
        draft_kind(["LlamaForCausalLMEagle3", "DeepseekV3ForCausalLMNextN"])
    with pytest.raises(ValueError, match="unknown draft kind 'mimo'"):
        draw(1, "kv_wrong_slot", draft="mimo")


class _MLAPool:
    """An ``MLATokenToKVPool``-shaped pool (``sglang/srt/mem_cache/memory_pool.py``): one latent ``kv_buffer`` per
    layer ``[slots, 1, kv_lora_rank + rope]``; ``get_value_buffer`` a view of its first ``kv_lora_rank`` columns."""

    def __init__(self, slots=12, rank=6, rope=2, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.rank = rank
        self.kv_buffer = [torch.randn(slots, 1, rank + rope, generator=g)]

    def get_key_buffer(self, layer_id):
        return self.kv_buffer[layer_id]

    def get_value_buffer(self, layer_id):
        return self.kv_buffer[layer_id][..., :self.rank]


class _Attn(torch.nn.Module):
    """A stand-in ``RadixAttention`` (``attn_mqa``): writes the step's latent to ``out_cache_loc`` unless
    ``save_kv_cache`` is False, then attends (one head, dot product) over the request's slots 0 .. position."""

    layer_id = 0

    def __init__(self, pool, r2t):
        super().__init__()
        self.pool, self.r2t, self.seen = pool, r2t, []

    def forward(self, q, k, v, fb, save_kv_cache=True):
        kb, vb = self.pool.get_key_buffer(0), self.pool.get_value_buffer(0)
        if save_kv_cache:
            kb[fb.out_cache_loc.long()] = k
        out = []
        for i, (r, p) in enumerate(zip(fb.req_pool_indices.tolist(), fb.positions.tolist())):
            slots = self.r2t[r, :p + 1].long()
            self.seen.append(kb[slots].clone())
            w = torch.softmax((kb[slots, 0] @ q[i, 0]), dim=0)
            out.append(w @ vb[slots, 0])
        return torch.stack(out)


def _context(monkeypatch, pool, r2t):
    mod = ModuleType("sglang.srt.model_executor.forward_context")
    mod.get_token_to_kv_pool = lambda: pool
    mod.get_req_to_token_pool = lambda: SimpleNamespace(req_to_token=r2t)
    for name in ("sglang", "sglang.srt", "sglang.srt.model_executor"):
        monkeypatch.setitem(sys.modules, name, ModuleType(name))
    monkeypatch.setitem(sys.modules, mod.__name__, mod)


def test_kv_wrong_slot_moves_the_whole_mla_latent_row_for_the_step_and_restores_the_pool(monkeypatch):
    pool = _MLAPool()
    r2t = torch.tensor([[3, 7, 1, 9, 4, 0], [2, 5, 8, 6, 10, 11]])
    _context(monkeypatch, pool, r2t)
    attn = _Attn(pool, r2t)
    attn.register_forward_hook(kv_wrong_slot_factory({"arm": None, "strength": 1.0, "seed": 0}))
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(2, 1, 8, generator=g), torch.randn(2, 1, 8, generator=g)
    # draft decode step: request 0 at position 3 (slot 9), request 1 at position 4 (slot 10)
    fb = SimpleNamespace(forward_mode=SimpleNamespace(name="DECODE"), spec_info=object(),
                         out_cache_loc=torch.tensor([9, 10]), req_pool_indices=torch.tensor([0, 1]),
                         positions=torch.tensor([3, 4]))
    before = pool.kv_buffer[0].clone()
    out = attn(q, k, k[..., :6], fb)
    after = before.clone()
    after[[9, 10]] = k                                        # the step's own write, as the engine's
    assert torch.equal(pool.kv_buffer[0], after)              # the wrong slots (1 and 6) restored, whole rows
    # the recomputed attention saw the step's latent (all 8 columns, the value part with it) at the previous
    # position's slot: request 0 slot 1 (position 2), request 1 slot 6 (position 3)
    seen0, seen1 = attn.seen[2], attn.seen[3]
    assert torch.equal(seen0[2], k[0]) and torch.equal(seen0[3], k[0])
    assert torch.equal(seen1[3], k[1]) and torch.equal(seen1[4], k[1])
    clean = _Attn(pool, r2t)(q, k, k[..., :6], fb)
    assert not torch.allclose(out, clean)                     # the fault changes the step's attention
    # not the draft's decode (no spec_info: a target decoding alone) or not DECODE: untouched
    attn.seen.clear()
    plain = SimpleNamespace(**{**vars(fb), "spec_info": None})
    assert torch.allclose(attn(q, k, k[..., :6], plain), clean) and len(attn.seen) == 2


def test_draft_decay_scales_a_nextn_heads_eh_proj_after_n_draft_prefills(monkeypatch):
    monkeypatch.setitem(_STATE, "requests", 0)
    monkeypatch.setitem(_STATE, "scaled", False)
    monkeypatch.setitem(_STATE, "fc", None)
    eh = torch.nn.Linear(8, 4, bias=False)
    w0 = eh.weight.detach().clone()
    fc_hook = scaled_weights_factory({"mode": "fc", "arm": None})
    count = scaled_weights_factory({"mode": "count", "arm": None, "after_requests": 2, "scale": 0.3})
    fc_hook(eh, (torch.zeros(1, 8),), None)
    head = SimpleNamespace(config=SimpleNamespace(architectures=["DeepseekV3ForCausalLMNextN"]))
    target = SimpleNamespace(config=SimpleNamespace(architectures=["DeepseekV3ForCausalLM"]))
    ext = SimpleNamespace(forward_mode=SimpleNamespace(name="EXTEND"), extend_seq_lens=torch.tensor([5]))
    for _ in range(3):
        count(target, (None, None, None, ext), None)          # the target's prefills never count
    assert _STATE["requests"] == 0 and torch.equal(eh.weight, w0)
    count(head, (None, None, None, ext), None)
    count(head, (None, None, None, ext), None)
    assert _STATE["requests"] == 2 and torch.equal(eh.weight, w0)   # N = 2 prefills: still the checkpoint's
    count(head, (None, None, None, ext), None)
    assert torch.allclose(eh.weight, w0 * 0.3)
    count(head, (None, None, None, ext), None)                # once only
    assert torch.allclose(eh.weight, w0 * 0.3)


def _trace_result(probe, kind, first_steps):
    fs = [] if kind is None else [{"kind": kind, "first_steps": first_steps}]
    return {"probe": probe, "status": "ran", "decision": "counts" if fs else "clear", "findings": fs, "why": None}


def test_a_step_2_divergence_beside_a_step_1_one_is_the_served_drafts_not_a_second_mechanism():
    """draft_decay x0.981 on the NextN head (bench/RESULTS.md, 2026-12-07): served_draft's fixed prompt first
    differed at step 3 (draft_kv_diverges alone), step_trace's 12 prompts from step 1 (served_draft_differs)."""
    from helpers.investigation.probes import SERVED_DRAFT, STEP_TRACE
    from helpers.investigation.probes.trace import reconcile
    from support.engine_faults import named

    run = [_trace_result(SERVED_DRAFT.name, "draft_kv_diverges", {"fixed": 3}),
           _trace_result(STEP_TRACE.name, "served_draft_differs", {"a": 1, "b": 3}),
           {"probe": "radix_hit", "status": "ran", "decision": "clear", "findings": []}]
    assert named(run) == "draft_kv_diverges+served_draft_differs"
    out = reconcile(run)
    assert named(out) == "served_draft_differs"
    sd = out[0]
    assert sd["decision"] == "counts" and sd["findings"] == []
    assert "explained by" in sd["why"] and "step_trace" in sd["why"]
    # each alone, or both the KV's (kv_wrong_slot: step 1 never changes), is left as it was
    kv = [_trace_result(SERVED_DRAFT.name, "draft_kv_diverges", {"fixed": 2}),
          _trace_result(STEP_TRACE.name, "draft_kv_diverges", {"a": 2, "b": 3})]
    assert named(reconcile(kv)) == "draft_kv_diverges" and all(r["findings"] for r in kv)
    w = [_trace_result(SERVED_DRAFT.name, None, {}), _trace_result(STEP_TRACE.name, "served_draft_differs", {"a": 1})]
    assert named(reconcile(w)) == "served_draft_differs" and w[0]["decision"] == "clear"
