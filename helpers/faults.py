"""The wiring faults the suite can inject on a server (``helpers.hooks`` applies them in SGLang's process through
``--forward-hooks``): one :class:`Fault` per diagnosis finding name. No torch here, so a case file is validated
without loading it; ``helpers.hooks.Fault`` is the same class.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any, Optional

FAULT_KINDS = ("chunk_order", "embedding_in_place_of_layer", "embedding_not_all_reduced",
               "wrong_layer", "layer_offset", "tp_partial_sum", "rotated_basis", "norm_mismatch",
               "nan_or_inf")


@dataclass
class Fault:
    """One injected wiring fault; ``kind`` is a diagnosis finding name.

    Fields used per kind: ``chunk`` (index of the aux chunk to corrupt), ``order`` (chunk_order:
    new order, e.g. [1, 0, 2]), ``layer`` (wrong_layer / tp_partial_sum: 0-based decoder layer L
    whose output out(L) to use or whose chunk it is), ``shift`` + ``layers`` (layer_offset:
    every chunk c becomes out(layers[c] + shift); ``layers`` in SpecForge out(i) convention),
    ``seed`` (rotated_basis), ``eps`` (norm_mismatch), ``every`` (nan_or_inf: every k-th row).
    """

    kind: str
    chunk: Optional[int] = None
    order: Optional[list[int]] = None
    layer: Optional[int] = None
    shift: Optional[int] = None
    layers: Optional[list[int]] = None
    seed: int = 0
    eps: float = 1e-6
    every: int = 7

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault kind '{self.kind}'; expected one of {FAULT_KINDS}")
        needs = {"chunk_order": ("order",), "embedding_in_place_of_layer": ("chunk",),
                 "embedding_not_all_reduced": ("chunk",), "wrong_layer": ("chunk", "layer"),
                 "layer_offset": ("shift", "layers"), "tp_partial_sum": ("chunk", "layer"),
                 "rotated_basis": ("chunk",), "norm_mismatch": ("chunk",),
                 "nan_or_inf": ("chunk",)}[self.kind]
        missing = [n for n in needs if getattr(self, n) is None]
        if missing:
            raise ValueError(f"fault '{self.kind}' needs field(s) {missing}")

    def stash_keys(self) -> list[str]:
        """Stashed tensors this fault reads (see :func:`hook_specs`)."""
        if self.kind == "embedding_in_place_of_layer":
            return ["embedding"]
        if self.kind == "embedding_not_all_reduced":
            return ["embedding_local"]
        if self.kind == "wrong_layer":
            return [f"out({self.layer})"]
        if self.kind == "layer_offset":
            return [f"out({L + self.shift})" for L in self.layers]
        if self.kind == "tp_partial_sum":
            return [f"resid_mid({self.layer})", f"mlp_partial({self.layer})"]
        return []


def parse_faults(text: str, what: str = "--faults") -> list[Fault]:
    """The faults of a JSON list of :class:`Fault` dicts (``server start --faults JSON``), checked here so a bad value
    is refused before any server starts: the same checks :meth:`Fault.__post_init__` makes where the hooks apply them
    (``helpers.hooks``), plus the list's own shape.

    Args:
        text: JSON, e.g. ``'[{"kind": "wrong_layer", "chunk": 0, "layer": 7}]'``.
        what: the flag or field named in the error.

    Raises:
        ValueError: one line naming ``what`` and what was expected: not JSON, not a list of objects, a field
            :class:`Fault` does not have, an unknown kind, a field the kind needs missing."""
    try:                               # stdlib json: this module sits below helpers.runfiles (tier 0)
        data: Any = json.loads(text)
    except (ValueError, RecursionError) as exc:      # not JSON, or nested past the parser's stack
        why = str(exc).splitlines()[0] if isinstance(exc, ValueError) else "nested too deep"
        raise ValueError(f"{what}: not JSON ({why}); expected a list of fault objects, e.g. "
                         '[{"kind": "wrong_layer", "chunk": 0, "layer": 7}]') from None
    if not isinstance(data, list):
        raise ValueError(f"{what}: expected a JSON list of fault objects, got {type(data).__name__}")
    known = {f.name for f in fields(Fault)}
    out = []
    for i, f in enumerate(data):
        if not isinstance(f, dict):
            raise ValueError(f"{what}: item {i}: expected an object with a 'kind', got {type(f).__name__}")
        extra = sorted(str(k) for k in f if k not in known)
        if extra:
            raise ValueError(f"{what}: item {i}: unknown field(s) {extra}; a fault takes {sorted(known)}")
        try:
            out.append(Fault(**f))
        except ValueError as exc:
            raise ValueError(f"{what}: item {i}: {exc}") from None
    return out
