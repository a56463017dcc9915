"""vLLM 0.32.0's rules as helpers.layers.vllm mirrors them, the counters of /metrics and the per-request record, and
the embedded server's launch checks, without a server (the live checks are tests/server/test_vllm_server.py)."""
from __future__ import annotations

import json

import pytest

from helpers.acceptance.requests import PER_REQUEST_COLUMNS
from helpers.engines.base import AcceptanceCounters
from helpers.engines.sglang import SGLangAdapter
from helpers.engines.vllm import VLLMAdapter, meta_info, parse_counters, record
from helpers.engines.vllm_server import build_command, check_target, omp_bind, start
from helpers.errors import BadServerInput
from helpers.layers import vllm as rules
from support.vllm_answers import LOGPROBS_CHOICE, METRICS_1

N = 8


@pytest.mark.parametrize("cfg, ids, source", [
    ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 4]}}, (1, 3, 4), "eagle_config"),
    ({"eagle_aux_hidden_state_layer_ids": [2, 5], "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 4]}},
     (2, 5), "draft config eagle_aux_hidden_state_layer_ids"),            # top level wins
    ({"eagle_aux_hidden_state_layer_ids": [], "eagle_config": {"eagle_aux_hidden_state_layer_ids": [6]}}, (6,),
     "eagle_config"),                                                     # empty top level falls through
    ({"eagle_config": {"use_aux_hidden_state": True}}, (2, 4, 5), "default"),   # key missing -> default
    ({}, (2, 4, 5), "default"),
    ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [4, 1, 3, 3]}}, (1, 3, 4), "eagle_config"),  # sorted, set
    ({"dflash_config": {"target_layer_ids": [0, 3]}}, (1, 4), "dflash_config"),
    ({"dflash_config": {"target_layer_ids": [0, 3]}, "eagle_config": {}}, (1, 4), "dflash"),  # {} is falsy
    ({"dflash_config": {"target_layer_ids": [0]}, "eagle_config": {"x": 1}}, (2, 4, 5), "default"),  # None wins
])
def test_aux_layer_ids_follow_vllm_0_32(cfg, ids, source):
    got, src = rules.aux_layer_ids(cfg, N)
    assert got == ids and source in src


def test_captured_tensors_use_the_in_i_convention_and_drop_unreachable_ids():
    assert rules.captured([0, 1, 3, 4, N], N) == ["embedding", "out(0)", "out(2)", "out(3)", f"out({N - 1})"]
    assert rules.captured([-1, N + 1], N) == [None, None]


def test_fc_width_counts_only_nested_ids_and_use_aux_defaults_true():
    assert rules.num_aux_hidden_states({"eagle_aux_hidden_state_layer_ids": [1, 2, 3, 4]}) == 3
    assert rules.num_aux_hidden_states({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 3, 4]}}) == 4
    assert rules.num_aux_hidden_states({"num_aux_hidden_states": 2, "eagle_config": {
        "eagle_aux_hidden_state_layer_ids": [1, 2, 3]}}) == 2
    assert rules.use_aux_hidden_state({}) and not rules.use_aux_hidden_state({"eagle_config": {
        "use_aux_hidden_state": False}})


def test_weight_sharing_and_d2t_rules():
    names = ["fc.weight", "midlayer.self_attn.q_proj.weight", "lm_head.weight", "d2t", "t2d"]
    assert rules.weight_sharing(names) == {"embedding": "target", "lm_head": "unknown"}
    assert rules.weight_sharing(names, lm_head_equal=False) == {"embedding": "target", "lm_head": "draft"}
    no_head = [n for n in names if "lm_head" not in n]
    assert rules.weight_sharing(no_head)["lm_head"] == "target"     # the target's full-vocabulary head
    assert rules.weight_sharing(names + ["embed_tokens.weight"], embed_equal=True)["embedding"] == "target"
    assert rules.weight_sharing(names + ["embed_tokens.weight"], embed_equal=False)["embedding"] == "draft"
    assert rules.weight_sharing(no_head, pipeline_parallel=2)["embedding"] == "draft"
    assert rules.d2t_rule(names, 256, 384) == "checkpoint"
    assert rules.d2t_rule(no_head[:2], 256, 384) == "zeros"
    assert rules.d2t_rule(names, None, 384) == "none" and rules.d2t_rule(names, 384, 384) == "none"


def test_known_versions():
    assert rules.is_known("0.32.0") and rules.is_known("0.32.0+cpu") and rules.is_known("v0.32.0rc1")
    assert not rules.is_known("0.31.2") and not rules.is_known("0.33.0") and not rules.is_known("dev")
    assert not rules.is_known(None)


def _second(text: str) -> str:
    # a second request of 9 tokens: 4 verify steps, 12 drafted, 4 accepted (2 steps accepted 2 and 1, ... by hand)
    repl = {"num_drafts_total{": "19.0", "num_draft_tokens_total{": "57.0", "num_accepted_tokens_total{": "4.0",
            'position="0"': "3.0", 'position="1"': "1.0", 'position="2"': "0.0", "generation_tokens_total{": "25.0",
            'finished_reason="length"': "2.0"}
    out = []
    for line in text.splitlines():
        for k, v in repl.items():
            if k in line and "_created" not in line:
                line = line.rsplit(" ", 1)[0] + " " + v
        out.append(line)
    return "\n".join(out) + "\n"


def test_counters_parse_delta_and_summary_by_hand():
    a = parse_counters(METRICS_1)
    assert (a.verify_steps, a.draft_tokens, a.accepted_tokens, a.generation_tokens, a.requests) == (15, 45, 0, 16, 1)
    assert a.accepted_per_position == [0, 0, 0]
    d = parse_counters(_second(METRICS_1)).delta(a)
    assert (d.verify_steps, d.draft_tokens, d.accepted_tokens, d.generation_tokens, d.requests) == (4, 12, 4, 9, 1)
    s = d.summary()
    assert s["accept_length"] == pytest.approx(9 / 4)          # tokens per verify step, prefill's token included
    assert s["accept_length_drafts"] == pytest.approx(1 + 4 / 4)  # vLLM's mean acceptance length
    assert s["accept_rate"] == pytest.approx(4 / 12)
    assert s["p_accept_ge"] == pytest.approx([3 / 4, 1 / 4, 0])
    with pytest.raises(ValueError, match="went down"):
        a.delta(parse_counters(_second(METRICS_1)))
    with pytest.raises(ValueError, match="cannot be subtracted"):
        d.delta(AcceptanceCounters(engine="sglang"))


def test_a_server_without_speculation_has_no_spec_counters():
    c = parse_counters('# TYPE vllm:generation_tokens counter\nvllm:generation_tokens_total{engine="0"} 7.0\n')
    assert c.verify_steps == 0 and c.accepted_tokens is None and c.accepted_per_position is None
    assert c.summary()["accept_length"] is None


#: the embedded server's answer to an 8-token completion (--per-request-spec-decode-metrics detailed), trimmed
ANSWER = {"choices": [{"index": 0, "finish_reason": "length", "token_ids": [7, 7, 9, 7, 7, 7, 3, 7]}],
          "usage": {"prompt_tokens": 20, "total_tokens": 28, "completion_tokens": 8, "prompt_tokens_details": None},
          "metrics": {"speculative_decoding": {
              "mean_acceptance_length": 1.75, "draft_acceptance_rate": 0.25, "acceptance_histogram": [1, 1, 1, 0],
              "num_spec_steps": 3, "num_accepted_draft_tokens": 3, "num_draft_tokens": 9, "num_spec_tokens": 3,
              "per_step_accepted": [0, 2, 1], "per_step_drafted": [3, 3, 3]}},
          "latency_s": 0.5}


def test_per_request_record_uses_sglangs_definitions():
    row = record(0, "p0", ANSWER)
    assert set(row) == set(PER_REQUEST_COLUMNS)
    assert (row["verify_ct"], row["correct_drafts"], row["proposed_drafts"]) == (3, 3, 9)
    assert row["accept_length"] == pytest.approx(8 / 3) and row["accept_rate"] == pytest.approx(3 / 9)
    assert row["hist_correct_drafts"] == 0 * 1 + 1 * 1 + 2 * 1 and json.loads(row["histogram"]) == [1, 1, 1, 0]
    assert row["server_accept_length"] == 1.75 and row["has_spec"] and row["tok_s"] == pytest.approx(16)
    bare = record(1, "p1", {k: v for k, v in ANSWER.items() if k != "metrics"})
    assert not bare["has_spec"] and bare["verify_ct"] is None and bare["completion_tokens"] == 8


def _cfg(tmp_path, **kw):
    cfg = {"architectures": ["LlamaForCausalLM"], "hidden_size": 128, "num_attention_heads": 8,
           "num_key_value_heads": 8, "num_hidden_layers": 8, **kw}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


def test_launch_checks_head_size_and_tp(tmp_path):
    with pytest.raises(BadServerInput, match="head_dim 16 is not one vLLM 0.32.0's CPU attention supports"):
        check_target(_cfg(tmp_path, head_dim=16), 1)
    assert check_target(_cfg(tmp_path, num_attention_heads=2, num_key_value_heads=2), 2)["hidden_size"] == 128
    with pytest.raises(BadServerInput, match="do not divide by tp 4"):
        check_target(_cfg(tmp_path, num_attention_heads=2, num_key_value_heads=2), 4)
    assert omp_bind(1, [0, 1]) == "0" and omp_bind(2, [0, 1]) == "0|1" and omp_bind(4, [0, 1]) == "0|1|0|1"
    cmd = build_command(tmp_path / "py", tmp_path, draft=tmp_path, tp=2, num_speculative_tokens=3, port=1234,
                        dtype="float32", max_model_len=512, max_num_seqs=4, api_key=None, extra_args=["--x"])
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1" and "--enforce-eager" in cmd and cmd[-1] == "--x"
    assert json.loads(cmd[cmd.index("--speculative-config") + 1])["num_speculative_tokens"] == 3
    assert cmd[cmd.index("--worker-extension-cls") + 1] == "helpers.engines.vllm_worker.CaptureExtension"
    assert "--enable-prompt-tokens-details" in cmd            # usage.prompt_tokens_details.cached_tokens (radix_hit)


def test_top_logprobs_of_a_vllm_answer_become_sglangs_output_top_logprobs():
    m = meta_info({"choices": [LOGPROBS_CHOICE], "usage": {"prompt_tokens": 10, "completion_tokens": 3}})
    assert m["output_top_logprobs"] == [[[-2.4548540115356445, 510, None], [-2.7506103515625, 316, None]],
                                        [[-2.1991231441497803, 9, None], [-3.0106446743011475, 16, None]],
                                        [[-1.882392168045044, 9, None], [-2.4128005504608154, 299, None]]]
    as_text = {**LOGPROBS_CHOICE, "logprobs": {**LOGPROBS_CHOICE["logprobs"],
                                               "top_logprobs": [{" a": -1.0, "x": -2.0}, None, {}]}}
    assert meta_info({"choices": [as_text]})["output_top_logprobs"] == [None, None, None]
    assert "output_top_logprobs" not in meta_info({"choices": [{"text": "x"}]})
    # the fields each engine is asked for
    assert VLLMAdapter().top_logprobs_fields(2) == {"logprobs": 2, "return_tokens_as_token_ids": True}
    assert SGLangAdapter().top_logprobs_fields(2) == {"return_logprob": True, "top_logprobs_num": 2}


def test_prefix_hits_follow_vllms_block_rule_as_measured():
    a = VLLMAdapter()
    eagle = {"speculative_algorithm": "EAGLE3", "block_size": 128, "cache_hit_alignment_tokens": 128}
    # measured on the embedded server (block 128, EAGLE-3 draft): 300 and 257 tokens hit 128, 256 hit 0
    assert [a.prefix_hit_tokens(eagle, n) for n in (300, 257, 256, 31)] == [128, 128, 0, 0]
    assert a.prefix_hit_tokens({**eagle, "speculative_algorithm": None}, 300) == 256     # no draft block dropped
    assert a.prefix_hit_tokens({"speculative_algorithm": "EAGLE3", "block_size": 32}, 100) == 64
    assert a.prefix_hit_tokens({"speculative_algorithm": "EAGLE3"}, 300) is None         # block size not reported
    assert a.prefix_cache_off({"enable_prefix_caching": False}).endswith("no hit to probe")
    assert a.prefix_cache_off({"enable_prefix_caching": True}) is None and a.prefix_cache_off({}) is None
    assert "--disable-radix-cache" in SGLangAdapter().prefix_cache_off({"disable_radix_cache": True})
    assert a.chunked_prefill_flags(7) == {"--enable-chunked-prefill": None, "--max-num-batched-tokens": "7",
                                          "--max-num-seqs": "1"}
    assert a.oracle_flags() == {"speculative_config.method": "draft_model"}


def test_the_oracle_copy_may_draft_with_a_model_that_is_no_eagle_draft(tmp_path):
    """``method: draft_model`` (the oracle: the target drafting for itself) takes any model as the draft; an EAGLE
    method still refuses a draft that is no EAGLE-3 class (both before any process starts: no vLLM interpreter)."""
    target = _cfg(tmp_path, num_attention_heads=2, num_key_value_heads=2)
    with pytest.raises(BadServerInput, match="is not an EAGLE-3 draft"):
        start(target, target, python=tmp_path / "no-python")
    with pytest.raises(BadServerInput, match="vLLM interpreter .* not found"):
        start(target, target, python=tmp_path / "no-python", speculative={"method": "draft_model"})


def test_the_worker_records_each_cycles_proposals_and_the_trace_reads_them_as_steps(tmp_path):
    """The worker extension's ``drafter.propose`` wrapper, called as vLLM 0.32.0's runner calls it (keywords), records
    the draft's inputs and what it returned; ``trace_records`` turns each call into one cycle per request: step 1 at
    the sampled row's position reading ``next_token_ids``, steps 2 .. fed the previous proposal."""
    import torch
    from types import SimpleNamespace
    from helpers.draft.trace import request_cycles
    from helpers.engines.vllm_capture import trace_records
    from helpers.engines.vllm_worker import CaptureExtension

    class Drafter:
        def propose(self, num_speculative_tokens, target_token_ids, target_positions, target_hidden_states,
                    next_token_ids, token_indices_to_sample, common_attn_metadata, sampling_metadata, **kw):
            common_attn_metadata.query_start_loc = torch.arange(2)         # vLLM rewrites it during propose
            return (next_token_ids.reshape(-1, 1) * 10 + torch.arange(1, num_speculative_tokens + 1)).to(torch.int64)

    target = torch.nn.Module()
    target.model = torch.nn.Module()
    runner = SimpleNamespace(get_model=lambda: target, drafter=Drafter(), input_batch=None)
    ext = CaptureExtension()
    ext.model_runner = runner
    ext.e3f_capture_start(json.dumps({"out_dir": str(tmp_path)}))
    h = torch.randn(9, 6)
    meta = SimpleNamespace(query_start_loc=torch.tensor([0, 5]))
    # the prefill (positions 0..4; the last row sampled) then a verify step (rows 5..8, the second accepted: row 6)
    out1 = runner.drafter.propose(num_speculative_tokens=3, target_token_ids=torch.arange(100, 105),
                                  target_positions=torch.arange(5), target_hidden_states=h[:5],
                                  next_token_ids=torch.tensor([7]), token_indices_to_sample=None,
                                  common_attn_metadata=meta, sampling_metadata=None)
    out2 = runner.drafter.propose(num_speculative_tokens=3, target_token_ids=torch.arange(105, 109),
                                  target_positions=torch.arange(5, 9), target_hidden_states=h[5:],
                                  next_token_ids=torch.tensor([8]), token_indices_to_sample=torch.tensor([1]),
                                  common_attn_metadata=SimpleNamespace(query_start_loc=torch.tensor([0, 4])),
                                  sampling_metadata=None)
    assert out1.tolist() == [[71, 72, 73]] and out2.tolist() == [[81, 82, 83]]
    assert ext.e3f_capture_stop()["proposes"] == 2 and "propose" not in vars(runner.drafter)
    recs = trace_records(tmp_path, ["p0"])
    assert [r["mode"] for r in recs] == ["DRAFT_EXTEND_V2", "DECODE", "DECODE"] * 2
    (c1, c2) = request_cycles(recs)["p0"]
    assert [(s.step, s.position, s.input_id, s.topk[0]) for s in c1.steps] == [(1, 4, 7, 71), (2, 5, 71, 72),
                                                                                  (3, 6, 72, 73)]
    assert [(s.step, s.position, s.input_id, s.topk[0]) for s in c2.steps] == [(1, 6, 8, 81), (2, 7, 81, 82),
                                                                                  (3, 8, 82, 83)]


def test_an_eagle1_draft_is_served_with_method_eagle(tmp_path, monkeypatch):
    """A draft whose architectures name EagleLlamaForCausalLM passes check_draft and is launched with ``method:
    eagle`` (vllm/config/speculative.py takes the method as given); an EAGLE-3 draft keeps eagle3; an explicit method
    wins. The argv is read where ServerProcess.launch_healthy would start it (no process is started)."""
    from helpers.engines import vllm_server
    from helpers.engines.vllm_server import check_draft, draft_method
    from helpers.server.process import ServerProcess
    (tmp_path / "t").mkdir()
    target = _cfg(tmp_path / "t", num_attention_heads=2, num_key_value_heads=2)
    draft = tmp_path / "d"
    draft.mkdir()
    (draft / "config.json").write_text(json.dumps({"architectures": ["EagleLlamaForCausalLM"], "hidden_size": 128}))
    assert draft_method(check_draft(draft)) == "eagle"
    assert draft_method({"architectures": ["LlamaForCausalLMEagle3"]}) == "eagle3"
    seen = []

    def fake_launch(cmd, *a, **k):
        seen.append(json.loads(cmd[cmd.index("--speculative-config") + 1]))
        raise RuntimeError("not started")

    monkeypatch.setattr(ServerProcess, "launch_healthy", staticmethod(fake_launch))
    py = tmp_path / "py"
    py.write_text("")
    for spec in (None, {"method": "eagle3"}):
        with pytest.raises(RuntimeError, match="not started"):
            vllm_server.start(target, draft, python=py, speculative=spec)
    assert [s["method"] for s in seen] == ["eagle", "eagle3"]
    assert seen[0]["model"] == str(draft) and seen[0]["num_speculative_tokens"] == 3
