"""An EAGLE-1 draft on the embedded vLLM 0.32.0 CPU server (method eagle, inferred from the draft's architectures):
what the server feeds ``drafter.propose`` is the target's post-final-norm state, and the offline Eagle1Draft replay
of the same greedy tokens accepts what the live counters count (bench/vllm_eagle1_accept.py::measure, one server)."""
from __future__ import annotations

import pytest

from support import ROOT, import_from

H64 = ROOT / "env" / "models" / "llama_h64"


@pytest.mark.extended   # 36 s at load ~8 on 2 cores: one vLLM server start, 8 prompts x 48 tokens, the HF replay
def test_eagle1_served_state_and_live_vs_offline_accept_length():
    bench = import_from(ROOT / "bench", "vllm_eagle1_accept")
    r = bench.measure(H64 / "target", H64 / "draft_eagle1", prompts=8, max_tokens=48, k=3)
    d = r["served_state_max_abs_diff"]
    assert d["post_final_norm (last_hidden_state)"] < 1e-4 < 0.5 < d["pre_final_norm (last layer output)"]
    live, off = r["live"], r["offline"]
    assert live["verify_steps"] == off["verify_steps"] > 0
    assert live["accepted_tokens"] > 0.2 * live["draft_tokens"]           # a trained draft, not chance
    # the replay on the same tokens counts the same accepted drafts up to float noise (2 of 535 in bench/RESULTS.md)
    assert abs(live["accepted_tokens"] - off["correct_drafts"]) <= max(3, 0.02 * live["accepted_tokens"])
