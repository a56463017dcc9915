"""helpers.draft.precision: the offline draft run's compute dtype as a function of (server dtype, device, CPU
capability), the capability injected; and that the environment overrides emulating an AVX2-only CPU are honoured."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from helpers.draft.precision import FP32_VS_BF16, CpuCapability, choose_dtype, server_dtype
from support import ROOT

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
#: an AVX-512 CPU with bf16 dot products (Zen 4, Cooper Lake), as torch reports it
ZEN4 = CpuCapability("AVX512", frozenset({"avx2", "avx512_f", "avx512_bw", "avx512_bf16"}))
#: an AVX2-only EPYC (Zen 2 / 3): torch cpu capability AVX2, no bf16 flag
EPYC_AVX2 = CpuCapability("AVX2", frozenset({"avx2", "fma3"}))
#: AVX-512 without bf16 (Skylake-SP, Ice Lake)
SKYLAKE = CpuCapability("AVX512", frozenset({"avx2", "avx512_f", "avx512_bw"}))
#: Sapphire Rapids: AMX tiles with bf16 and fp16
SPR = CpuCapability("AVX512", frozenset({"avx2", "avx512_f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16",
                                         "amx_fp16"}))
#: Graviton 3 (Neoverse V1): bf16 on ARM
GRAVITON3 = CpuCapability("SVE256", frozenset({"neon", "sve", "bf16", "sve_bf16"}), architecture="aarch64")


@pytest.mark.parametrize("cap, server, want, flag", [
    (ZEN4, BF16, BF16, "avx512_bf16"),
    (SPR, BF16, BF16, "amx_bf16"),
    (SPR, FP16, FP16, "amx_fp16"),
    (GRAVITON3, BF16, BF16, "sve_bf16"),
    (EPYC_AVX2, BF16, FP32, None),
    (SKYLAKE, BF16, FP32, None),
    (ZEN4, FP16, FP32, None),                                        # bf16 dot products are no fp16 ones
    (CpuCapability("SVE256", frozenset({"neon", "sve"}), architecture="aarch64"), BF16, FP32, None),
])
def test_the_server_dtype_is_kept_where_this_cpu_computes_it_natively(cap, server, want, flag):
    c = choose_dtype(server, "cpu", capability=cap)
    assert c.dtype == want and c.reason.startswith(f"{c.name}: the server computes in {str(server)[6:]}"), c.reason
    assert cap.native(server) == flag
    if want == FP32:
        assert f"lacks native {'bf16' if server == BF16 else 'fp16'} (torch cpu capability {cap.aten})" in c.reason
        assert (FP32_VS_BF16 in c.reason) == (server == BF16), c.reason
    else:
        assert f"has native {'bf16' if server == BF16 else 'fp16'} ({flag}, torch cpu capability {cap.aten})" \
            in c.reason, c.reason


@pytest.mark.parametrize("aten, isa, native", [
    ("AVX512", None, True), ("AVX2", None, False),                 # ATEN_CPU_CAPABILITY=avx2
    ("AVX512", "AVX2", False), ("AVX512", "AVX512_CORE", False),  # ONEDNN_MAX_CPU_ISA below bf16 dot products
    ("AVX512", "AVX512_CORE_BF16", True), ("AVX512", "AVX10_1_512_AMX", True),
    ("AVX512", "NOT_AN_ISA", True),                                # oneDNN ignores a name it does not know
])
def test_the_overrides_that_change_torchs_kernels_change_the_choice(aten, isa, native):
    cap = CpuCapability(aten, ZEN4.flags, onednn_max_isa=isa)
    c = choose_dtype(BF16, "cpu", capability=cap)
    assert c.dtype == (BF16 if native else FP32), c.reason
    if isa is not None:
        assert f"ONEDNN_MAX_CPU_ISA={isa}" in c.reason


def test_a_float32_server_a_gpu_and_a_requested_dtype():
    assert choose_dtype(FP32, "cpu", capability=ZEN4).dtype == FP32
    assert choose_dtype(FP32, "cpu", capability=ZEN4).reason == "float32: the server computes in float32"
    # not a CPU: the server's dtype, whatever the host CPU lacks
    gpu = choose_dtype(BF16, "cuda:0", capability=EPYC_AVX2)
    assert gpu.dtype == BF16 and gpu.reason == "bfloat16: the server computes in bfloat16, as the cuda device does " \
                                              "natively"
    asked = choose_dtype(FP32, "cpu", capability=EPYC_AVX2, requested=BF16)
    assert asked.dtype == BF16 and asked.reason.startswith("bfloat16: as asked (--dtype bfloat16); this CPU lacks "
                                                           "native bf16 (torch cpu capability AVX2)"), asked.reason
    assert choose_dtype(BF16, "cpu", capability=ZEN4, requested=FP32).reason == "float32: as asked (--dtype float32)"
    note = choose_dtype(BF16, "cpu", capability=ZEN4, server_note="the draft config's torch_dtype")
    assert note.reason.startswith("bfloat16: the server computes in bfloat16 (the draft config's torch_dtype) and")


@pytest.mark.parametrize("info, raw, want", [
    ({"dtype": "float32"}, {"torch_dtype": "bfloat16"}, FP32),      # the embedded reference server
    ({"dtype": "auto"}, {"torch_dtype": "bfloat16"}, BF16),
    ({}, {"dtype": "float16"}, FP16),
    ({"dtype": "half"}, {}, FP16),
    # _get_and_verify_dtype: a float32 or unset config dtype is downcast under auto (gemma: to bf16)
    ({"dtype": "auto"}, {"torch_dtype": "float32"}, FP16),
    ({}, {}, FP16),
    ({}, {"model_type": "gemma2"}, BF16),
])
def test_server_dtype_reads_server_info_then_the_draft_config(info, raw, want):
    assert server_dtype(info, raw) == want


def test_detect_honours_the_avx2_emulation():
    """ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2: torch reports AVX2 and bf16 is not native, on any x86 CPU
    (the flags the CPU itself has are still read)."""
    code = ("from helpers.draft.precision import CpuCapability as C; import torch; c = C.detect(); "
            "print(c.aten, c.onednn_max_isa, c.native(torch.bfloat16), 'avx2' in c.flags)")
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "avx2", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["AVX2", "AVX2", "None", "True"], out.stdout
