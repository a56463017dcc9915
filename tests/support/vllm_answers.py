"""Answers recorded from the embedded vLLM 0.32.0 server (trimmed), for tests without a server."""
from __future__ import annotations

#: /metrics of the embedded vLLM 0.32.0 server after one 16-token completion with a random draft (trimmed), and after
#: a second request: tests/unit/engines/test_vllm_pure.py computes the delta by hand
METRICS_1 = """# TYPE vllm:spec_decode_num_drafts counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="/tmp/h64/target"} 15.0
vllm:spec_decode_num_drafts_created{engine="0",model_name="/tmp/h64/target"} 1.796207426856698e+09
# TYPE vllm:spec_decode_num_draft_tokens counter
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="/tmp/h64/target"} 45.0
# TYPE vllm:spec_decode_num_accepted_tokens counter
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="/tmp/h64/target"} 0.0
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="/tmp/h64/target",position="0"} 0.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="/tmp/h64/target",position="1"} 0.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="/tmp/h64/target",position="2"} 0.0
# TYPE vllm:generation_tokens counter
vllm:generation_tokens_total{engine="0",model_name="/tmp/h64/target"} 16.0
# TYPE vllm:request_success counter
vllm:request_success_total{engine="0",finished_reason="length",model_name="/tmp/h64/target"} 1.0
vllm:request_success_total{engine="0",finished_reason="stop",model_name="/tmp/h64/target"} 0.0
"""
