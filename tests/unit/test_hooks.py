"""Fault injection and per-rank capture through SGLang's own ``--forward-hooks`` flag (helpers.hooks),
without a server: each fault on synthetic chunks, and the hook specs SGLang receives. The same hooks on
a live TP 2 reference server: tests/server/test_hooks_live.py.
"""
from __future__ import annotations

import json

import pytest
import torch

from helpers.hooks import CaptureConfig, Fault, _Stash, apply_fault, hook_specs


def _chunks(t=6, h=16, n=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(t, h, generator=g) for _ in range(n)]


def test_fault_validation():
    with pytest.raises(ValueError, match="unknown fault kind"):
        Fault(kind="bogus")
    with pytest.raises(ValueError, match=r"needs field\(s\) \['chunk'\]"):
        Fault(kind="embedding_in_place_of_layer")


def test_chunk_order_rotation_norm_nan():
    ch = _chunks()
    out = apply_fault(Fault("chunk_order", order=[2, 0, 1]), ch)
    assert all(torch.equal(a, b) for a, b in zip(out, [ch[2], ch[0], ch[1]]))
    rot = apply_fault(Fault("rotated_basis", chunk=1, seed=3), ch)[1]
    torch.testing.assert_close(rot.norm(dim=1), ch[1].norm(dim=1), rtol=1e-5, atol=1e-5)
    cos = torch.nn.functional.cosine_similarity(rot, ch[1], dim=1)
    assert cos.abs().mean() < 0.5
    normed = apply_fault(Fault("norm_mismatch", chunk=0), ch)[0]
    torch.testing.assert_close(normed.pow(2).mean(1), torch.ones(6), rtol=1e-4, atol=1e-4)
    nan = apply_fault(Fault("nan_or_inf", chunk=2, every=3), ch)[2]
    assert torch.isnan(nan[::3]).all() and not torch.isnan(nan[1::3]).any()
    assert torch.equal(apply_fault(Fault("nan_or_inf", chunk=2), ch)[0], ch[0])


def test_tp_partial_sum_sums_to_truth_over_ranks():
    t, h, tp = 5, 8, 2
    g = torch.Generator().manual_seed(1)
    resid = torch.randn(t, h, generator=g)
    partials = [torch.randn(t, h, generator=g) for _ in range(tp)]
    truth = resid + sum(partials)
    per_rank = []
    for r in range(tp):
        st = _Stash()
        st.put("resid_mid(3)", resid)
        st.put("mlp_partial(3)", partials[r])
        per_rank.append(apply_fault(Fault("tp_partial_sum", chunk=1, layer=3),
                                    _chunks(t, h), st, rank=r, tp=tp)[1])
    torch.testing.assert_close(per_rank[0] + per_rank[1], truth)
    assert not torch.allclose(per_rank[0], per_rank[1])


def test_stale_stash_is_refused():
    st = _Stash()
    st.put("embedding", torch.zeros(2, 4))
    st.seq += 1  # a new forward started; the entry is from the previous one
    with pytest.raises(RuntimeError, match="not recorded during this forward"):
        apply_fault(Fault("embedding_in_place_of_layer", chunk=0), _chunks(2, 4), st)


def test_hook_specs_place_stash_hooks_on_sglang_module_names():
    specs = hook_specs([Fault("wrong_layer", chunk=0, layer=7), Fault("tp_partial_sum", chunk=1, layer=3)],
                       CaptureConfig(out_dir="/tmp/x", keys=["embedding_local", "out(2)"]),
                       num_layers=8)
    modules = {s["name"]: s["target_modules"][0] for s in specs}
    assert modules["e3f-stash-embedding"] == "model.embed_tokens"
    assert modules["e3f-stash-out(7)"] == "model.norm"  # last layer: the final add-norm
    assert modules["e3f-stash-out(2)"] == "model.layers.3.input_layernorm"
    assert modules["e3f-stash-resid_mid(3)"] == "model.layers.3.post_attention_layernorm"
    assert modules["e3f-stash-mlp_partial(3)"] == "model.layers.3.mlp.down_proj"
    names = [s["name"] for s in specs]
    assert names.index("e3f-faults") < names.index("e3f-capture")  # capture sees the faulted aux
    json.dumps(specs)  # must travel as --forward-hooks JSON
    with pytest.raises(ValueError, match="layer outside"):
        hook_specs([Fault("wrong_layer", chunk=0, layer=8)], num_layers=8)


# ---------------------------------------------------------------- model families (one adapter per target family)
def test_model_family_from_the_target_config():
    from helpers.hooks import DEEPSEEK, KIMI_K25, LLAMA, model_family

    assert model_family(["DeepseekV3ForCausalLM"]) is DEEPSEEK
    assert model_family(["DeepseekV2ForCausalLM"]) is DEEPSEEK
    assert model_family(None, "deepseek_v3") is DEEPSEEK              # architecture inferred from model_type
    assert model_family(["KimiK25ForConditionalGeneration"]) is KIMI_K25
    assert model_family(["LlamaForCausalLM"]) is LLAMA
    assert model_family(["NotAnSGLangModel"]) is LLAMA


def test_hook_specs_on_deepseek_and_kimi_k25_module_names():
    """MoE layers have no mlp.down_proj: the mlp module's own output is the rank's partial; Kimi-K2.5 nests the
    DeepSeek text model under language_model. (logits processor included)."""
    from helpers.hooks import DEEPSEEK, KIMI_K25

    faults = [Fault("tp_partial_sum", chunk=1, layer=3), Fault("wrong_layer", chunk=0, layer=7)]
    cap = CaptureConfig(out_dir="/tmp/x", keys=["embedding_local", "out(2)", "attn_partial(1)"])
    ds = {s["name"]: s["target_modules"][0] for s in hook_specs(faults, cap, num_layers=8, family=DEEPSEEK)}
    assert ds["e3f-stash-mlp_partial(3)"] == "model.layers.3.mlp"
    assert ds["e3f-stash-resid_mid(3)"] == "model.layers.3.post_attention_layernorm"
    assert ds["e3f-stash-out(7)"] == "model.norm" and ds["e3f-stash-out(2)"] == "model.layers.3.input_layernorm"
    assert ds["e3f-stash-attn_partial(1)"] == "model.layers.1.self_attn.o_proj"
    assert ds["e3f-faults"] == ds["e3f-capture"] == "logits_processor"
    kimi = {s["name"]: s["target_modules"][0] for s in hook_specs(faults, cap, num_layers=8, family=KIMI_K25)}
    assert kimi["e3f-stash-embedding"] == "language_model.model.embed_tokens"
    assert kimi["e3f-stash-mlp_partial(3)"] == "language_model.model.layers.3.mlp"
    assert kimi["e3f-stash-out(7)"] == "language_model.model.norm"
    assert kimi["e3f-faults"] == kimi["e3f-capture"] == "language_model.logits_processor"


class _LogitsOut:
    def __init__(self, hidden_states):
        self.hidden_states = hidden_states


class _FakeLogitsProcessor(torch.nn.Module):
    def __init__(self, arch):
        super().__init__()
        self.config = type("C", (), {"architectures": [arch]})()


@pytest.mark.parametrize("packed", [False, True], ids=["list (Llama)", "packed (DeepSeek)"])
def test_fault_hook_reads_listed_and_packed_aux(packed):
    """The logits processor receives the aux states as a list of K [T, H] tensors (AuxHiddenStateList, Llama) or as
    ONE [T, K*H] tensor (AuxHiddenStatePacker, DeepSeek): the fault hook splits both into K chunks."""
    from helpers.hooks import aux_chunk_count, fault_factory

    t, h = 5, 16
    chunks = _chunks(t, h, 3, seed=4)
    cat = torch.cat(chunks, dim=1)
    aux = cat.clone() if packed else [c.clone() for c in chunks]
    final = torch.randn(t, h)
    assert aux_chunk_count(aux, final) == 3
    assert aux_chunk_count(None, final) == 0 and aux_chunk_count([], final) == 0
    hook = fault_factory({"faults": [{"kind": "chunk_order", "order": [2, 0, 1]}]})
    module = _FakeLogitsProcessor("DeepseekV3ForCausalLM" if packed else "LlamaForCausalLM")
    out = hook(module, (torch.arange(t), final, None, None, aux), _LogitsOut(cat.clone()))
    torch.testing.assert_close(out.hidden_states, torch.cat([chunks[2], chunks[0], chunks[1]], dim=1))
    draft = _FakeLogitsProcessor("Eagle3DeepseekV2ForCausalLM")            # the MLA draft's processor: untouched
    assert hook(draft, (torch.arange(t), final, None, None, aux), _LogitsOut(cat.clone())) is None


def test_fault_hook_on_a_nextn_server_replaces_the_one_final_state():
    """EAGLE / NEXTN (no aux): the target's logits processor gets aux None and stores its final (post-norm) hidden
    state [T, H] (logits_processor.py::_get_hidden_states_to_store); the wrong_layer fault with the last layer
    replaces that one state by the stashed out(n-1), the pre-norm residual (the fault investigate names
    norm_mismatch); the NextN head's own processor (DeepseekV3ForCausalLMNextN) is left untouched."""
    from helpers.hooks import STASH, fault_factory

    t, h = 6, 16
    g = torch.Generator().manual_seed(7)
    final, pre = torch.randn(t, h, generator=g), torch.randn(t, h, generator=g)
    STASH.put("out(7)", pre)
    hook = fault_factory({"faults": [{"kind": "wrong_layer", "chunk": 0, "layer": 7}]})
    out = hook(_FakeLogitsProcessor("DeepseekV3ForCausalLM"), (torch.arange(t), final, None, None, None),
               _LogitsOut(final.clone()))
    torch.testing.assert_close(out.hidden_states, pre)
    head = _FakeLogitsProcessor("DeepseekV3ForCausalLMNextN")
    assert hook(head, (torch.arange(t), final, None, None, None), _LogitsOut(final.clone())) is None
    # a state of another width than the final hidden state is no single chunk: untouched
    assert hook(_FakeLogitsProcessor("DeepseekV3ForCausalLM"), (torch.arange(t), final, None, None, None),
                _LogitsOut(torch.randn(t, 2 * h, generator=g))) is None
