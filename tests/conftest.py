"""Shared fixtures: tiny random models built once per test session."""
from __future__ import annotations

from pathlib import Path

import pytest

from support.tinymodels import build_eagle3_draft, build_target


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory) -> Path:
    """Random fp32 Llama: hidden 64, 8 layers, 8 heads / 8 KV heads, vocab 384."""
    return build_target(tmp_path_factory.mktemp("models") / "tiny-target")


@pytest.fixture(scope="session")
def tiny_draft(tmp_path_factory, tiny_target) -> Path:
    """Random EAGLE-3 draft for ``tiny_target``; ids [1, 3, 4] (SpecForge default for n=8)."""
    return build_eagle3_draft(tmp_path_factory.mktemp("models") / "tiny-draft", tiny_target,
                              layer_ids=[1, 3, 4])


# --- diagnosis-engine fixtures (tests/unit/diagnosis/) ------------------------------------------
# Tiny models on a 2-core CI: intra-op threads only add contention.
import torch  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def runner32(tiny_target):
    from support.forensic_cases import TargetRunner
    return TargetRunner(tiny_target, torch.float32)


@pytest.fixture(scope="session")
def runner16(tiny_target):
    from support.forensic_cases import TargetRunner
    return TargetRunner(tiny_target, torch.bfloat16)


@pytest.fixture(scope="session")
def specs(runner32):
    """Three prompts with greedy continuations (training) and 6 greedy output tokens (served)."""
    from support.forensic_cases import make_samples
    return make_samples(runner32, 3)


@pytest.fixture(scope="session")
def target36(tmp_path_factory):
    """A 36-layer tiny Llama (gpt-oss-like depth) for the final-boundary case."""
    return build_target(tmp_path_factory.mktemp("models") / "tiny-target-36", layers=36, seed=3)


@pytest.fixture(scope="session")
def kimi(tmp_path_factory):
    """The Kimi-class target (DeepseekV3ForCausalLM: MLA, 8 routed experts top-2 + 1 shared) and its two EAGLE-3
    drafts (LlamaForCausalLMEagle3, Eagle3DeepseekV2ForCausalLM): trained ones from env/models/kimi/ when present,
    else random ones of the same shapes (support.kimi.kimi_models)."""
    from support.kimi import kimi_models
    return kimi_models(tmp_path_factory.mktemp("kimi"))
