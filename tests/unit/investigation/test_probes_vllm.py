"""The engine-state probes on vLLM without a server: the real vLLM client and adapter against a stateful fake of the
embedded vLLM 0.32.0 server (support.vllm_answers.FakeVLLM: its prefix-cache hit rule, per-request spec metrics and
top log-probabilities as the embedded server answered them). Each probe's requests and records on vLLM: the radix hit
(long prompts hit whole blocks less the EAGLE block; short ones are skipped saying why), repeatability, and the
restart probes' copies (chunked prefill as vLLM's token budget, the target alone with top-2 log-probabilities, the
target drafting for itself)."""
from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path
from types import SimpleNamespace

import pytest

from helpers.acceptance.prompts import load_prompts
from helpers.budget import Budget
from helpers.engines.vllm import VLLMAdapter, VLLMClient
from helpers.investigation.probes import ProbeContext, run_probes
from support.fakeserver import in_thread
from support.vllm_answers import FakeVLLM


def _prompts(n: int, length: int) -> list:
    return load_prompts([{"id": f"p{i}", "input_ids": [i] + [(13 * j + i) % 400 + 1 for j in range(length - 1)]}
                         for i in range(n)])


class Copies(VLLMAdapter):
    """The vLLM adapter whose restarted copies are fake vLLM servers: ``make(flags, draft, keep_draft)`` gives each
    copy's :class:`FakeVLLM`; ``started`` records what each was asked for, ``stopped`` counts stops."""

    def __init__(self, stack: ExitStack, make):
        self.stack, self.make, self.started, self.stopped, self.fakes = stack, make, [], 0, []

    def start_variant(self, restart, *, draft=None, keep_draft=True, flags=None, **kw):
        fake = self.make(dict(flags or {}), draft, keep_draft)
        self.fakes.append(fake)
        self.started.append((dict(flags or {}), draft, keep_draft))
        url = self.stack.enter_context(in_thread(fake.handler()))

        def stop():
            self.stopped += 1
        return SimpleNamespace(url=url, stop=stop)


def _ctx(tmp_path: Path, client, adapter, prompts, restart=None) -> ProbeContext:
    return ProbeContext(client=client, adapter=adapter, run_dir=tmp_path, prompts=prompts, max_new_tokens=25,
                        dl=Budget(600.0), att=SimpleNamespace(restart=restart, target_dir=tmp_path / "target",
                                                              spec={"num_steps": 3, "topk": 1}))


def _by_name(state: dict) -> dict:
    return {p["probe"]: p for p in state["probes"]}


def test_radix_hit_on_vllm_measures_a_hit_of_whole_blocks_and_counts_a_loss(tmp_path):
    fake = FakeVLLM(lambda i, cached: (0 if cached else 2) if i % 4 else 2)     # hits lose drafts on 6 of 8
    with in_thread(fake.handler()) as url, VLLMClient(url) as c:
        st = run_probes(_ctx(tmp_path, c, VLLMAdapter(), _prompts(8, 300)), "cheap")
    r = _by_name(st)["radix_hit"]
    assert r["status"] == "ran" and r["decision"] == "counts", r
    # 300 tokens, block 128, the EAGLE block recomputed: (299 // 128) * 128 - 128 = 128 cached on every hit
    assert r["evidence"]["cached_tokens"] == {"min": 128, "max": 128, "prompts_with_hit": 8}
    assert r["evidence"]["expected_cached_tokens"] == [128] * 8
    # 25 tokens: the prefill's, then 8 verify steps of 3 (25 / 8), or 24 steps of 1 on a hit that accepts nothing
    assert r["evidence"]["cold_accept_length"] == pytest.approx(25 / 8)
    assert r["evidence"]["condition_accept_length"] == pytest.approx(8 * 25 / (2 * 8 + 6 * 24))
    assert r["findings"][0]["kind"] == "cache_state_loses_acceptance"
    # what was sent: /v1/completions with the prompt's ids, greedy, 25 tokens (cold, then radix: 1-token fill + 25)
    bodies = fake.seen
    assert all(b["temperature"] == 0.0 and b["ignore_eos"] is True and b["return_token_ids"] is True for b in bodies)
    radix = [b["max_tokens"] for b in bodies[-16:]]
    assert radix == [1, 25] * 8 and bodies[-1]["prompt"] == list(_prompts(8, 300)[7].input_ids)
    rep = _by_name(st)["repeatable"]
    assert rep["evidence"]["same"] is True and len(rep["evidence"]["answers"]) == 2


def test_radix_hit_on_vllm_is_clear_when_hits_accept_the_same(tmp_path):
    fake = FakeVLLM(lambda i, cached: 1 + i % 3)
    with in_thread(fake.handler()) as url, VLLMClient(url) as c:
        r = _by_name(run_probes(_ctx(tmp_path, c, VLLMAdapter(), _prompts(8, 260)), "cheap"))["radix_hit"]
    assert r["decision"] == "clear" and r["loss"]["delta"] == 0 and r["evidence"]["cached_tokens"]["min"] == 128


def test_radix_hit_on_vllm_skips_prompts_no_block_of_which_can_hit(tmp_path):
    fake = FakeVLLM()
    with in_thread(fake.handler()) as url, VLLMClient(url) as c:
        st = run_probes(_ctx(tmp_path, c, VLLMAdapter(), _prompts(4, 40)), "cheap")
    r = _by_name(st)["radix_hit"]
    assert r["status"] == "skipped" and "the longest has 40 tokens" in r["why"] and "needs 257" in r["why"]
    assert not any(b["max_tokens"] == 1 for b in fake.seen)                      # no fill request was sent
    for name in ("served_draft", "step_trace"):    # the fake's worker extension answers: the trace needs the draft
        assert _by_name(st)[name]["status"] == "skipped" and "pass --draft" in _by_name(st)[name]["why"]


def test_radix_hit_on_vllm_without_prompt_tokens_details_says_the_hit_is_unknown(tmp_path):
    fake = FakeVLLM(details=False)
    with in_thread(fake.handler()) as url, VLLMClient(url) as c:
        r = _by_name(run_probes(_ctx(tmp_path, c, VLLMAdapter(), _prompts(4, 300)), "cheap"))["radix_hit"]
    assert r["decision"] == "undecided" and "--enable-prompt-tokens-details" in r["loss"]["settle"]["text"]


def test_radix_hit_on_vllm_without_prefix_caching_is_skipped(tmp_path):
    with in_thread(FakeVLLM(prefix_caching=False).handler()) as url, VLLMClient(url) as c:
        r = _by_name(run_probes(_ctx(tmp_path, c, VLLMAdapter(), _prompts(2, 300)), "cheap"))["radix_hit"]
    assert r["status"] == "skipped" and "--no-enable-prefix-caching" in r["why"]


def _copy(flags, draft, keep_draft, *, margin=1.0):
    if not keep_draft:                                       # the target alone: prompt 0's output 3 differs
        return FakeVLLM(draft=False, flip=lambda i: 3 if i == 0 else None, margin=margin)
    if flags.get("speculative_config.method") == "draft_model":
        return FakeVLLM(lambda i, cached: 3)                 # the target drafting for itself: all accepted
    return FakeVLLM(lambda i, cached: 0 if i % 2 else 2)     # chunk borders lose drafts on odd prompts


def test_restart_probes_on_vllm_start_copies_with_vllms_flags_and_read_its_answers(tmp_path):
    main = FakeVLLM()
    with ExitStack() as stack:
        url = stack.enter_context(in_thread(main.handler()))
        c = stack.enter_context(VLLMClient(url))
        copies = Copies(stack, _copy)
        st = run_probes(_ctx(tmp_path, c, copies, _prompts(12, 20), restart={"kind": "embedded"}), "all")
    r = _by_name(st)
    assert copies.stopped == 3 and [s[2] for s in copies.started] == [True, False, True]
    (chunk_flags, _, _), (_, _, _), (oracle_flags, oracle_draft, _) = copies.started
    # a chunk of half the shortest prompt (10 tokens), at least a verify step's 4: vLLM's token budget, one sequence
    assert chunk_flags == {"--enable-chunked-prefill": None, "--max-num-batched-tokens": "10", "--max-num-seqs": "1"}
    assert r["chunked_prefill"]["decision"] == "counts" and r["chunked_prefill"]["evidence"]["chunk_tokens"] == 10
    # the target alone was asked for vLLM's top-2 log-probabilities, token ids as keys, and its margin was read
    alone = copies.fakes[1]
    assert all(b["logprobs"] == 2 and b["return_tokens_as_token_ids"] is True for b in alone.seen)
    lossless = r["greedy_lossless"]
    assert lossless["decision"] == "counts", lossless
    (d,) = lossless["findings"][0]["evidence"]["divergences"]
    assert (d["prompt_id"], d["position"], d["near_tie"]) == ("p0", 3, False) and d["margin"] == pytest.approx(1.0)
    assert oracle_flags == {"speculative_config.method": "draft_model"} and oracle_draft == tmp_path / "target"
    o = r["oracle"]
    assert o["status"] == "ran" and o["evidence"]["floor"]["delta"] == pytest.approx(0.0)
    assert "vLLM speculative_config.method draft_model" in o["why"]
    # vLLM's draft model drafts on the target's own sequence: no caveat
    assert o["evidence"]["engine_caveat"] is None and o["why"].endswith("not a stage loss)")


def test_greedy_lossless_on_vllm_a_near_tie_is_no_finding(tmp_path):
    with ExitStack() as stack:
        url = stack.enter_context(in_thread(FakeVLLM().handler()))
        c = stack.enter_context(VLLMClient(url))
        copies = Copies(stack, lambda f, d, k: _copy(f, d, k, margin=0.001))
        r = _by_name(run_probes(_ctx(tmp_path, c, copies, _prompts(4, 20), restart={"kind": "embedded"}),
                                "all"))["greedy_lossless"]
    assert r["decision"] == "clear" and r["findings"] == [] and "near ties" in r["why"]
    assert r["evidence"]["near_ties"][0]["margin"] == pytest.approx(0.001)
