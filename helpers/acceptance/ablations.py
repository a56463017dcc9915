"""Engine ablations: the engine features public reports blame for low EAGLE-3 acceptance, each one SGLang flag,
measured on a restarted copy of the server against the unchanged server with a paired CI over the same prompts.

Each :class:`Toggle` names its SGLang 0.5.23 flag (checked against ``sglang/srt/server_args.py::
ServerArgs.add_cli_args`` by the tests), the report it comes from, and :meth:`Toggle.skip_reason`: why it does not
apply to this server (its version, its device, or the feature already off), read from ``/server_info``. A toggle
that does not apply is listed with that reason and never measured.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Mapping, Optional

from ..layers.sglang import parse_version

#: the SGLang version whose flags this table was checked against
CHECKED_VERSION = "0.5.23"


@dataclasses.dataclass(frozen=True)
class Toggle:
    """One engine feature turned off (or switched) by an engine's launch flags (this module: SGLang 0.5.23's;
    ``helpers.engines.vllm.TOGGLES``: vLLM 0.32.0's).

    ``flags``: flag -> value (None: a switch such as ``--disable-radix-cache``); ``speculative=False`` is the
    non-speculative baseline (every ``--speculative-*`` flag dropped: the target alone, for tok/s); ``report``: the
    public report that blames the feature; ``why``: what the toggle tests."""

    name: str
    flags: Mapping[str, Optional[str]]
    report: str
    why: str
    check: Callable[[Mapping], Optional[str]] = dataclasses.field(default=lambda info: None, repr=False)
    speculative: bool = True
    #: measured at the ablation's temperature (before and after alike): a verification-sampling toggle, which
    #: changes nothing under greedy verification
    sampled: bool = False

    def skip_reason(self, info: Mapping) -> Optional[str]:
        """Why this toggle does not apply to the server of ``info`` (``/server_info``), or None when it does."""
        v = _version(info)
        if v is not None and v < (0, 5):
            return (f"SGLang {info.get('version')}: this table holds SGLang {CHECKED_VERSION}'s flags; older "
                    f"versions name them otherwise")
        return self.check(info)


def _version(info: Mapping) -> Optional[tuple]:
    """The server's SGLang version as a tuple, or None when ``/server_info`` gives none or one that is not X.Y.Z (a
    server may say anything: the toggles then apply as to the checked version)."""
    try:
        return parse_version(str(info.get("version") or ""))
    except ValueError:
        return None


def _cpu(info: Mapping) -> bool:
    return str(info.get("device") or "").lower() == "cpu"


def _already(key: str, value, text: str) -> Callable[[Mapping], Optional[str]]:
    def check(info: Mapping) -> Optional[str]:
        return text if info.get(key) == value else None
    return check


def _overlap(info: Mapping) -> Optional[str]:
    if info.get("disable_overlap_schedule"):
        why = ("SGLang turns the overlap scheduler off for speculative decoding on CPU "
               "(sglang/srt/arg_groups/speculative_hook.py::_disable_overlap_schedule_for_cpu)") if _cpu(info) \
            else "the overlap scheduler is already off (--disable-overlap-schedule)"
        return why
    return None


def _cuda_graph(info: Mapping) -> Optional[str]:
    if _cpu(info):
        return "no CUDA graphs on a CPU server"
    if info.get("disable_cuda_graph"):
        return "CUDA graphs are already off"
    return None


def _attention(info: Mapping) -> Optional[str]:
    if _cpu(info):
        return f"a CPU server runs its own attention backend ({info.get('attention_backend')}); triton needs a GPU"
    if info.get("attention_backend") == "triton":
        return "the attention backend is already triton"
    return None


def _spec_v1(info: Mapping) -> Optional[str]:
    v = _version(info)
    if v is not None and v >= (0, 5, 23):
        return (f"SGLang {info.get('version')} serves EAGLE-3 with spec v2 only (no v1 switch: "
                f"sglang/srt/arg_groups/speculative_hook.py, 'Non-overlap (synchronous) spec v2 is used')")
    return "this tool knows no spec v1 / v2 switch for this version"


def _no_spec(info: Mapping) -> Optional[str]:
    return None if info.get("speculative_algorithm") else "the server runs without a draft already"


TOGGLES: tuple[Toggle, ...] = (
    Toggle("radix_cache_off", {"--disable-radix-cache": None},
           "https://github.com/sgl-project/sglang/issues/10846 (accept length 2.26 with the radix cache, 2.39 "
           "without); https://github.com/vllm-project/vllm/issues/41838 (3.07 -> 2.8 after hours of traffic)",
           "prefix-cache KV reuse: the draft's KV of a cached prefix may not be the one it would compute",
           _already("disable_radix_cache", True, "the radix cache is already off")),
    Toggle("chunked_prefill_off", {"--chunked-prefill-size": "-1"},
           "https://github.com/openvinotoolkit/openvino/pull/33975 (EAGLE-3 aux states must be kept across "
           "prefill chunks)",
           "a prompt prefilled in chunks: the draft's aux states and KV at chunk borders",
           lambda info: ("chunked prefill is already off" if (info.get("chunked_prefill_size") or 0) in (-1, 0)
                         else None)),
    Toggle("overlap_schedule_off", {"--disable-overlap-schedule": None},
           "https://github.com/sgl-project/sglang/issues/28405 (an overlap / plan-stream flag changes acceptance)",
           "the overlap scheduler runs the next batch's draft while the last one is verified", _overlap),
    Toggle("cuda_graph_off", {"--disable-cuda-graph": None},
           "https://github.com/sgl-project/sglang/issues/28405 (graph replay and the draft's buffers)",
           "CUDA-graph replay of draft and verify (padded batch sizes, stale buffers)", _cuda_graph),
    Toggle("attention_backend_triton", {"--attention-backend": "triton"},
           "https://github.com/NVIDIA/TensorRT-LLM/issues/4168 (acceptance depends on the attention kernel and "
           "batch size)",
           "another attention kernel for target verify and draft", _attention),
    Toggle("sampling_backend_pytorch", {"--sampling-backend": "pytorch"},
           "https://github.com/vllm-project/vllm/issues/40551 (sampling and strict acceptance)",
           "another sampling kernel for verification",
           _already("sampling_backend", "pytorch", "the sampling backend is already pytorch")),
    Toggle("spec_v1", {}, "https://github.com/sgl-project/sglang/issues/28405 (spec v1 vs v2 workers)",
           "the older speculative worker", _spec_v1),
    Toggle("draft_off", {}, "https://github.com/sgl-project/sglang/issues/15307 (accept length unchanged, tok/s "
           "129 -> 114: compare with the target alone)",
           "the non-speculative baseline: does speculation pay at all", _no_spec, speculative=False),
)
BY_NAME = {t.name: t for t in TOGGLES}


def flag_text(flags: Mapping[str, Optional[str]]) -> str:
    """The flags as command-line words (``--disable-radix-cache --chunked-prefill-size -1``)."""
    return " ".join(k if v is None else f"{k} {v}" for k, v in flags.items())
#: what `ablate` measures by default: every toggle that applies, cheapest first
DEFAULT_TOGGLES = ("radix_cache_off", "chunked_prefill_off", "overlap_schedule_off", "cuda_graph_off",
                   "attention_backend_triton", "sampling_backend_pytorch", "spec_v1", "draft_off")


def toggles(names: Optional[list[str] | tuple[str, ...]] = None) -> list[Toggle]:
    """The toggles named (default :data:`DEFAULT_TOGGLES`); raises ValueError naming an unknown one."""
    out = []
    for n in names or DEFAULT_TOGGLES:
        if n not in BY_NAME:
            raise ValueError(f"unknown toggle {n!r}; known: {', '.join(BY_NAME)}")
        out.append(BY_NAME[n])
    return out
