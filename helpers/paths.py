"""Where things are in this checkout (one place): the repository root and the shipped reference models, cases,
notebooks and SGLang environment."""
from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REFERENCE_TARGET = ROOT / "env" / "models" / "target"
REFERENCE_DRAFT = ROOT / "env" / "models" / "draft"
REFERENCE_TRAINING = ROOT / "env" / "models" / "data" / "sample"
DEFAULT_CASE = ROOT / "env" / "cases" / "seeds_hunt.yaml"
NOTEBOOK_DIR = ROOT / "notebooks"
OUTPUTS = ROOT / "outputs"
DEFAULT_SGLANG_PYTHON = ROOT / "env" / "reference" / ".venv" / "bin" / "python"


def outputs_dir() -> Path:
    """Where new run folders go and where notebooks look for the newest one: ``$E3F_OUTPUTS`` or ``outputs/``."""
    return Path(os.environ.get("E3F_OUTPUTS") or OUTPUTS)
