"""The worker extension's check of the per-token sampling values vLLM's verify step uses at temperature > 0
(``helpers.engines.vllm_worker._verify_sampling_check``), run in env/vllm/.venv on vLLM 0.32.0's own function with the
CPU platform's kernels registered as its worker registers them (``CpuPlatform.import_kernels`` /
``register_triton_kernel_overrides``), without a server: the CPU override returns values other than the request's
(uninitialised memory), and with a correct expand in its place the same check passes."""
from __future__ import annotations

import json
import subprocess

import pytest

from helpers.engines.vllm_server import vllm_python
from helpers.paths import ROOT

CHECK = r"""
import json, sys, torch
sys.path.insert(0, sys.argv[1])
from vllm.platforms import current_platform
current_platform.import_kernels()
current_platform.register_triton_kernel_overrides()
from vllm.triton_utils import HAS_TRITON
from vllm.v1.sample import rejection_sampler as rs
from helpers.engines.vllm_worker import _verify_sampling_check
served = _verify_sampling_check()
def expand(x, cu, n, replace_from=0, replace_to=0):       # what the Triton kernel computes, in torch
    counts = torch.diff(cu.to(torch.int64), prepend=torch.zeros(1, dtype=torch.int64))
    x = torch.where(x == replace_from, torch.as_tensor(replace_to, dtype=x.dtype), x)
    return torch.repeat_interleave(x, counts)[:n]
rs.expand_batch_to_tokens = expand
print(json.dumps({"served": served, "control": _verify_sampling_check(), "triton": HAS_TRITON}))
"""


@pytest.mark.skipif(not vllm_python().exists(), reason="env/vllm/.venv is missing (make setup without SKIP_VLLM=1)")
def test_vllms_cpu_expand_of_sampling_values_is_caught_and_a_correct_one_passes():
    out = subprocess.run([str(vllm_python()), "-c", CHECK, str(ROOT)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["triton"] is False                        # the CPU env runs without Triton (env/vllm/README.md)
    served, control = got["served"], got["control"]
    assert served["function"] == "vllm.v1.sample.rejection_sampler.expand_batch_to_tokens"
    assert served["equal"] is False, served
    t = served["fields"]["temperature"]
    assert t["expected"] == [0.5, 0.5, 1.25, 2.0, 2.0, 2.0] and t["expanded"] != t["expected"] and not t["equal"]
    assert control["equal"] is True and all(f["equal"] for f in control["fields"].values()), control
    assert control["fields"]["top_k"]["expanded"] == [5, 5, 40, 7, 7, 7]
