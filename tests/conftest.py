"""Shared fixtures: tiny random models built once per test session."""
from __future__ import annotations

from pathlib import Path

import pytest

from support.tinymodels import build_eagle3_draft, build_target

#: the tiers whose tests start real servers, notebooks or a browser: under xdist (``make test``: ``-n logical``) they
#: form one work unit, run in order on one worker as they would without xdist (module-scoped servers shared, no two
#: servers competing), while the other workers take the unit tier beside them
SERIAL_TIERS = ("server", "suite", "env")


def serial_scope(nodeid: str) -> str:
    """The xdist work unit of a test's node id: ``"serial"`` for a test of :data:`SERIAL_TIERS`
    (``tests/<tier>/...``), else the test itself."""
    parts = nodeid.split("/", 2)
    return "serial" if len(parts) == 3 and parts[0] == "tests" and parts[1] in SERIAL_TIERS else nodeid


def pytest_xdist_make_scheduler(config, log):
    """xdist's load-scope scheduler with :func:`serial_scope` as its unit (largest unit first: the serial tiers start
    at once). A scheduler, not ``xdist_group`` marks: pytest 9.2 keeps the node id in ``Node._id``, so xdist 3.8's
    ``--dist loadgroup`` (which renames ``item._nodeid``) no longer groups anything."""
    from xdist.scheduler import LoadScopeScheduling  # lazy: only under xdist

    class SerialTiers(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return serial_scope(nodeid)

    return SerialTiers(config, log)


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
