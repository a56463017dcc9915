"""Where things are in this checkout (one place): the repository root and the shipped reference models, cases,
notebooks and SGLang environment; and the mode new files and folders of a run folder get (:func:`shared_mode`).
Imports nothing but the standard library (the capture hooks use it inside SGLang)."""
from __future__ import annotations

import functools
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REFERENCE_TARGET = ROOT / "env" / "models" / "target"
REFERENCE_DRAFT = ROOT / "env" / "models" / "draft"
REFERENCE_TRAINING = ROOT / "env" / "models" / "data" / "sample"
#: rows of the reference draft's training-log kind (validation split, sampled continuations) for the draft stage
REFERENCE_VALIDATION = ROOT / "env" / "models" / "data" / "validation"
DEFAULT_CASE = ROOT / "env" / "cases" / "seeds_hunt.yaml"
NOTEBOOK_DIR = ROOT / "notebooks"
OUTPUTS = ROOT / "outputs"
DEFAULT_SGLANG_PYTHON = ROOT / "env" / "reference" / ".venv" / "bin" / "python"


@functools.lru_cache(maxsize=1)
def _umask() -> int:
    """The process umask, read without changing it (``/proc/self/status``; 0o022 where that is not available)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022


def shared_mode(folder: bool = False) -> int:
    """The mode a new file (``0o666``) or folder (``0o777``) gets under this process's umask: what the files of a run
    folder are given when a library creates them narrower (``tempfile.mkstemp`` / ``mkdtemp``: 0600 / 0700,
    safetensors: 0600), so that a run folder meant to be shared is as readable as the umask allows, never less."""
    return (0o777 if folder else 0o666) & ~_umask()


def outputs_dir() -> Path:
    """Where new run folders go and where notebooks look for the newest one: ``$E3F_OUTPUTS`` or ``outputs/``."""
    return Path(os.environ.get("E3F_OUTPUTS") or OUTPUTS)
