"""The compute dtype of the offline draft run: what the server computes in, run in what this device does natively.

The server computes the draft in its ``--dtype`` (``auto``: the checkpoint's ``torch_dtype``; GPU servers usually
``bfloat16``, the embedded CPU reference server ``float32``). The offline run follows it where this device computes
that dtype natively: on CUDA, and on a CPU with bf16 dot-product instructions (AVX512_BF16 or AMX-BF16, reached
through oneDNN's ``brg_matmul:avx512_core_bf16``). A CPU without them (an AVX2-only EPYC: torch reports cpu
capability ``AVX2``) runs a bf16 ``F.linear`` through ATen's own converting kernels, several times slower than
float32 (bench/RESULTS.md: 6.2 s vs 0.9 s for one 512 x 7168 x 18432 linear on a user's AVX2 EPYC); there the run
computes in float32, whose results differ from bf16 by :data:`FP32_VS_BF16` on the reference drafts.

The capability is what torch itself dispatches on, so the overrides that change torch's kernels change the choice
too: ``ATEN_CPU_CAPABILITY`` (read back through ``torch.backends.cpu.get_cpu_capability()``) and oneDNN's
``ONEDNN_MAX_CPU_ISA`` / ``DNNL_MAX_CPU_ISA`` (torch's bf16 matmul takes oneDNN only when
``ideep::has_bf16_type_support()``, which honours that cap: ``aten/src/ATen/native/mkldnn/Utils.h::
mkldnn_bf16_device_check``). ``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2`` on an AVX-512 machine thus
reproduces an AVX2-only CPU (bench/bench_simulate.py measures both side by side).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, Optional

import torch

#: dtype names as SGLang's ``--dtype`` and config.json ``torch_dtype`` write them -> torch dtype
DTYPE_NAMES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
               "float16": torch.float16, "half": torch.float16}

#: how far float32 results are from bfloat16 ones on the reference drafts (bench/bench_dtype.py, bench/RESULTS.md:
#: env/models/draft and draft_alt, 64 held-out prompts x 64 tokens and their 3 training samples each)
FP32_VS_BF16 = ("about 1 % of draft argmaxes (98.7-99.2 % agree per step), <= 0.003 in per-step accuracy and "
                "<= 0.011 tokens in accept length (64 held-out prompts, reference drafts)")

#: oneDNN's CPU ISA names (``ONEDNN_MAX_CPU_ISA``, oneDNN's dnnl_cpu_isa_t), in the order oneDNN ranks them; the
#: ones from ``AVX512_CORE_BF16`` on have bf16 dot products, from ``AVX10_1_512`` on fp16 ones
_ONEDNN_ISAS = ("SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI",
                "AVX512_CORE_BF16", "AVX10_1_512", "AVX512_CORE_FP16", "AVX10_1_512_AMX", "AVX512_CORE_AMX",
                "AVX10_1_512_AMX_FP16", "AVX512_CORE_AMX_FP16", "AVX10_2_512", "AVX10_2_512_AMX_2", "DEFAULT", "ALL")
#: per low-precision dtype: the CPU flags (``torch.cpu.get_capabilities()`` keys) that compute it natively, and the
#: lowest oneDNN ISA that uses them
_NATIVE = {torch.bfloat16: (("amx_bf16", "avx512_bf16", "sve_bf16", "bf16"), "AVX512_CORE_BF16"),
           torch.float16: (("amx_fp16", "avx512_fp16", "fp16_arith"), "AVX10_1_512")}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def server_dtype(info: Mapping, draft_raw: Mapping) -> torch.dtype:
    """The dtype the server computes the draft in: ``/server_info`` ``dtype``; ``auto`` or absent: as
    ``sglang/srt/configs/model_config.py::_get_and_verify_dtype`` resolves it from the draft config: its ``dtype`` /
    ``torch_dtype`` when bf16 / fp16; a float32 or unset one is downcast to float16 (bfloat16 for a ``gemma*``
    ``model_type``). An unknown name gives float32."""
    name = str(info.get("dtype") or "auto").lower()
    if name != "auto":
        return DTYPE_NAMES.get(name, torch.float32)
    cfg = DTYPE_NAMES.get(str(draft_raw.get("dtype") or draft_raw.get("torch_dtype") or "float32"), torch.float32)
    if cfg != torch.float32:
        return cfg
    return torch.bfloat16 if str(draft_raw.get("model_type") or "").startswith("gemma") else torch.float16


@dataclass(frozen=True)
class CpuCapability:
    """What this CPU computes natively, as torch dispatches.

    Attributes:
        aten: ``torch.backends.cpu.get_cpu_capability()`` (``"AVX512"``, ``"AVX2"``, ``"DEFAULT"``, ``"SVE256"``,
            ...), which honours ``ATEN_CPU_CAPABILITY``.
        flags: the CPU's own feature flags that are set (``torch.cpu.get_capabilities()`` keys: ``avx512_bf16``,
            ``amx_bf16``, ``bf16`` on ARM, ...).
        onednn_max_isa: ``ONEDNN_MAX_CPU_ISA`` (or ``DNNL_MAX_CPU_ISA``), upper-cased, or None when unset.
        architecture: ``x86_64``, ``aarch64``, ... (``torch.cpu.get_capabilities()["architecture"]``).
    """

    aten: str
    flags: frozenset = frozenset()
    onednn_max_isa: Optional[str] = None
    architecture: str = "x86_64"

    @classmethod
    def detect(cls) -> "CpuCapability":
        """This process's CPU as torch sees it (the environment overrides included)."""
        get = getattr(torch.cpu, "get_capabilities", None)
        if get is not None:
            caps = dict(get())
        else:                    # torch before get_capabilities: its probes (every AMX CPU has AMX-BF16 with its tiles)
            probes = {"avx512_bf16": "_is_avx512_bf16_supported", "amx_bf16": "_is_amx_tile_supported",
                      "amx_fp16": "_is_amx_fp16_supported", "avx2": "_is_avx2_supported"}
            caps = {k: bool(getattr(torch.cpu, f, lambda: False)()) for k, f in probes.items()}
        isa = os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA")
        return cls(aten=str(torch.backends.cpu.get_cpu_capability()),
                   flags=frozenset(k for k, v in caps.items() if v is True),
                   onednn_max_isa=isa.strip().upper() if isa and isa.strip() else None,
                   architecture=str(caps.get("architecture") or "x86_64"))

    def native(self, dtype: torch.dtype) -> Optional[str]:
        """The flag that makes ``dtype`` native here (``"avx512_bf16"``, ``"amx_bf16"``, ...), or None when the CPU
        has none, or an override caps it below (ATen capability under AVX512 on x86, oneDNN's max ISA under the
        flag's). float32 is always native (``"float32"``)."""
        if dtype == torch.float32:
            return "float32"
        if dtype not in _NATIVE:
            return None
        names, min_isa = _NATIVE[dtype]
        hit = next((f for f in names if f in self.flags), None)
        if hit is None or not self.architecture.startswith(("x86", "amd64", "AMD64")):
            return hit
        if self.aten != "AVX512":
            return None
        isa = self.onednn_max_isa
        if isa in _ONEDNN_ISAS and _ONEDNN_ISAS.index(isa) < _ONEDNN_ISAS.index(min_isa):
            return None                      # an unknown name is ignored by oneDNN, so here too
        return hit

    def describe(self) -> str:
        """``torch cpu capability AVX2, ONEDNN_MAX_CPU_ISA=AVX2`` (the overrides only when set)."""
        return f"torch cpu capability {self.aten}" + (f", ONEDNN_MAX_CPU_ISA={self.onednn_max_isa}"
                                                      if self.onednn_max_isa else "")


@dataclass(frozen=True)
class DtypeChoice:
    """The compute dtype of the offline draft run and why (``reason`` starts with the dtype's name)."""

    dtype: torch.dtype
    reason: str

    @property
    def name(self) -> str:
        """The dtype's name (``"float32"``)."""
        return dtype_name(self.dtype)


def choose_dtype(server: torch.dtype, device: str | torch.device = "cpu", *,
                 capability: Optional[CpuCapability] = None, requested: Optional[torch.dtype] = None,
                 server_note: str = "") -> DtypeChoice:
    """The dtype to run the draft in offline: the server's (``server``, from :func:`server_dtype`) where ``device``
    computes it natively, else float32 (a CPU without native bf16 / fp16).

    Args:
        server: the dtype the server computes in.
        device: the torch device of the offline run; anything but ``cpu`` follows the server.
        capability: the CPU's (default :meth:`CpuCapability.detect`); injected by tests.
        requested: a dtype the user asked for (``simulate --dtype``): taken as asked, the reason saying when it is
            not native here.
        server_note: where ``server`` was read, added in brackets (e.g. ``the draft config's torch_dtype``).

    Returns:
        :class:`DtypeChoice`, e.g. ``float32: the server computes in bfloat16 but this CPU lacks native bf16
        (torch cpu capability AVX2) ...``.
    """
    srv = dtype_name(server)
    said = f"the server computes in {srv}" + (f" ({server_note})" if server_note else "")
    on_cpu = torch.device(device).type == "cpu"
    cap = (capability or CpuCapability.detect()) if on_cpu else None
    short = {torch.bfloat16: "bf16", torch.float16: "fp16"}
    if requested is not None:
        why = f"{dtype_name(requested)}: as asked (--dtype {dtype_name(requested)})"
        if cap is not None and cap.native(requested) is None:
            why += (f"; this CPU lacks native {short.get(requested, dtype_name(requested))} ({cap.describe()}): its "
                    "matmuls run several times slower than float32")
        return DtypeChoice(requested, why)
    if server == torch.float32:
        return DtypeChoice(torch.float32, f"float32: {said}")
    if cap is None:
        return DtypeChoice(server, f"{srv}: {said}, as the {torch.device(device).type} device does natively")
    hit = cap.native(server)
    if hit is not None:
        return DtypeChoice(server, f"{srv}: {said} and this CPU has native {short.get(server, srv)} ({hit}, "
                                   f"{cap.describe()})")
    diff = f"; float32 results differ from bfloat16 by {FP32_VS_BF16}" if server == torch.bfloat16 else ""
    return DtypeChoice(torch.float32, f"float32: {said} but this CPU lacks native {short.get(server, srv)} "
                                      f"({cap.describe()}): {srv} matmuls would run several times slower{diff}")
