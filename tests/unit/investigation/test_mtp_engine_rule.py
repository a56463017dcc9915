"""The served-state identification of an MTP head follows the serving engine's rule, read through the adapter seam
(EngineAdapter.mtp_fed_state): SGLang 0.5.23 and vLLM 0.32.0 feed a DeepSeek-V3 head norm(out(n-1)); vLLM feeds a
MiMo head out(n-1), before the final norm. On real tensors: the Kimi-class target's every-layer reference of its
greedy continuations (the world of test_mtp_state.py, built again for this module: about 10-30 s on 2 busy cores)."""
from __future__ import annotations

from pathlib import Path

from helpers.engines.sglang import SGLangAdapter
from helpers.engines.vllm import VLLMAdapter
from helpers.investigation.mtp import POST_NORM, identify_state, reference_sequences, state_findings, state_line
from support import import_from

_state = import_from(Path(__file__).parent, "test_mtp_state")
_served, world = _state._served, _state.world       # the module-scoped fixture, reused (built again here)


def test_adapters_give_each_family_its_engine_rule():
    assert SGLangAdapter().mtp_fed_state("deepseek_v3")[0] == POST_NORM
    assert VLLMAdapter().mtp_fed_state("deepseek_v3")[0] == POST_NORM
    exp, src = VLLMAdapter().mtp_fed_state("mimo")
    assert exp == "out(n-1)" and "mimo.py::MiMoModel.forward" in src
    assert SGLangAdapter().mtp_fed_state("mimo")[0] == POST_NORM          # no SGLang MiMo rule read: the default
    # the steps rule cited in the settings finding, and its fix in the engine's own flags
    assert SGLangAdapter().mtp_steps_source is None
    assert "llm_base_proposer.py::SpecDecodeBaseProposer.propose" in VLLMAdapter().mtp_steps_source
    from types import SimpleNamespace
    args = {"--speculative-num-steps": 1, "--speculative-eagle-topk": 1, "--speculative-num-draft-tokens": 2}
    assert VLLMAdapter().fix_flags(SimpleNamespace(server_args=args)) == {
        "speculative_config.num_speculative_tokens": 1}


def test_pre_norm_state_is_right_under_vllms_mimo_rule_and_post_norm_is_the_finding(world):
    seqs, ref, w, eps, _ = world
    pre = _served(world, "out(7)")
    ident = identify_state(pre, ref, w, eps, expected="out(n-1)", source="rule", engine="vLLM")
    assert ident["expected"] == "out(7)" and ident["matches"] and ident["best_rel_error"] < 1e-6
    assert state_findings(ident, None) == []
    # the same tensors judged by SGLang's rule are the pre-norm fault
    sg = identify_state(pre, ref, w, eps)
    assert not sg["matches"] and state_findings(sg, None)[0]["kind"] == "norm_mismatch"
    post = _served(world, POST_NORM)
    ident = identify_state(post, ref, w, eps, expected="out(n-1)", source="rule", engine="vLLM")
    f = state_findings(ident, None)
    assert [x["kind"] for x in f] == ["norm_mismatch"]
    assert "AFTER the final norm" in f[0]["detail"] and "vLLM feeds this head the last layer output out(7)" in \
        f[0]["detail"]
    assert "out(7), what vLLM feeds" in state_line(ident)


def test_reference_states_follow_the_rule(world):
    seqs, ref, w, eps, _ = world
    raw = _served(world, "out(7)")
    for r, want in zip(reference_sequences(ref, seqs, w, eps, "out(n-1)"), raw):
        assert ((r.aux.float() - want.aux.float()).norm() / want.aux.float().norm()).item() < 1e-6
    for r, post in zip(reference_sequences(ref, seqs, w, eps, "out(n-1)"), reference_sequences(ref, seqs, w, eps)):
        assert ((r.aux.float() - post.aux.float()).norm() / post.aux.float().norm()).item() > 0.1
