"""Registration of the stand-in ops under ``torch.ops.sgl_kernel`` and call tracing.

SGLang's CPU engine calls its kernels two ways:

* as dispatcher ops, ``torch.ops.sgl_kernel.<name>(...)`` (layers, attention, collectives);
* as Python functions, ``from sgl_kernel import <name>`` (EAGLE bookkeeping, KV copies).

The dispatcher ops are defined here with ``torch.library`` so that SGLang's own probes behave as
with the real C++ extension: ``hasattr(torch.ops.sgl_kernel, "convert_weight_packed")`` is True
(``sglang/srt/utils/common.py::_is_intel_amx_backend_available``), while ops this stand-in does not
define (``gptq_marlin_repack``, ``fused_qk_norm_cpu``, ...) stay absent, so SGLang's
``register_fake_if_exists`` / ``hasattr`` probes skip them. A few ops that SGLang only *references*
at import time (``torch.ops.sgl_kernel.apply_rotary_pos_emb_cpu`` in
``sglang/srt/layers/rotary_embedding/utils.py``) are defined as stubs that raise
``NotImplementedError`` naming the op when called.

Tracing: with ``E3F_STANDIN_TRACE=<dir>`` each process appends the name of every stand-in op it
calls (first call only) to ``<dir>/ops.<pid>.txt``. Tests use it to prove which ops a server
configuration really exercises.
"""
from __future__ import annotations

import functools
import os
from typing import Callable

import torch

LIB = torch.library.Library("sgl_kernel", "DEF")  # noqa: TOR901 - one definition per process

_TRACE_DIR = os.environ.get("E3F_STANDIN_TRACE")
_seen: set[str] = set()


def trace(name: str, fn: Callable) -> Callable:
    """Wrap ``fn`` so its first call in this process is recorded under ``E3F_STANDIN_TRACE``."""
    if not _TRACE_DIR:
        return fn

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if name not in _seen:
            _seen.add(name)
            try:
                os.makedirs(_TRACE_DIR, exist_ok=True)
                with open(os.path.join(_TRACE_DIR, f"ops.{os.getpid()}.txt"), "a") as fh:
                    fh.write(name + "\n")
            except OSError:
                pass
        return fn(*args, **kwargs)

    return wrapper


def define(schema: str, fn: Callable, *, dispatch_key: str = "CompositeExplicitAutograd") -> None:
    """Define ``sgl_kernel::<name>`` with ``schema`` and register the Python kernel ``fn``."""
    name = schema.split("(", 1)[0]
    LIB.define(schema)
    LIB.impl(name, trace(name, fn), dispatch_key)


def not_implemented(name: str) -> Callable:
    """A callable that raises ``NotImplementedError`` naming ``name`` (SGLang op not covered)."""

    def _raise(*_args, **_kwargs):
        raise NotImplementedError(
            f"sgl_kernel stand-in: op '{name}' is not implemented. The stand-in covers only the "
            "ops of SGLang's Llama + EAGLE-3 CPU path (see env/reference/README.md)."
        )

    _raise.__name__ = name
    return _raise


def define_stub(schema: str) -> None:
    """Define an op that SGLang references at import time but that no covered path calls."""
    name = schema.split("(", 1)[0]
    LIB.define(schema)
    LIB.impl(name, trace(name, not_implemented(name)), "CompositeExplicitAutograd")
