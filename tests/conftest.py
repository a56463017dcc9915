"""Shared fixtures: tiny random models built once per test session."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from tinymodels import build_eagle3_draft, build_target  # noqa: E402


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory) -> Path:
    """Random fp32 Llama: hidden 64, 8 layers, 8 heads / 8 KV heads, vocab 384."""
    return build_target(tmp_path_factory.mktemp("models") / "tiny-target")


@pytest.fixture(scope="session")
def tiny_draft(tmp_path_factory, tiny_target) -> Path:
    """Random EAGLE-3 draft for ``tiny_target``; ids [1, 3, 4] (SpecForge default for n=8)."""
    return build_eagle3_draft(tmp_path_factory.mktemp("models") / "tiny-draft", tiny_target,
                              layer_ids=[1, 3, 4])
