"""The finding builder every detector uses (DESIGN.md "Findings")."""
from __future__ import annotations

from typing import Any, Optional

from ...kinds import FINDING_KINDS
from ...runfiles import jsonable


def finding(kind: str, chunk: Optional[int], detail: str, **evidence: Any) -> dict:
    """Build a finding dict; ``kind`` must be declared in :mod:`helpers.kinds`.

    Raises:
        ValueError: unknown kind.
    """
    if kind not in FINDING_KINDS:
        raise ValueError(f"unknown finding kind {kind!r}")
    return {"kind": kind, "chunk": chunk, "detail": detail, "evidence": jsonable(evidence, sig=6, keep_inf=True)}
