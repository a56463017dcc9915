"""Make PyPI torchvision importable next to the CPU build of torch.

PyPI's torchvision wheel ships a ``_C`` extension linked against CUDA torch; under the CPU
torch wheel its ``_meta_registrations`` / ``_autograd_registrations`` modules raise
``RuntimeError: operator torchvision::nms does not exist`` at import. SGLang 0.5.23 imports
torchvision only for ``torchvision.transforms`` (``sglang/srt/multimodal/internvl_utils.py``),
which needs neither registration module. This script rewrites the one import statement in
``torchvision/__init__.py`` so those two modules are skipped when they fail. It is idempotent
(a marker comment is checked) and exits non-zero with a clear message if the file does not have
the expected shape.

Usage: python fix_torchvision.py   (run with the server venv's interpreter)
"""
from __future__ import annotations

import importlib.util
import os
import sys
import tempfile

MARKER = "# eagle3-forensics: torchvision CPU import fix"
ORIGINAL = """from torchvision import (
    _autograd_registrations,
    _meta_registrations,
    datasets,
    io,
    models,
    ops,
    transforms,
    utils,
)  # usort:skip"""
REPLACEMENT = f"""{MARKER}
try:
    from torchvision import _autograd_registrations, _meta_registrations  # noqa: F401
except RuntimeError:  # torchvision::nms missing: CUDA-linked _C under CPU torch
    pass
from torchvision import datasets, io, models, ops, transforms, utils  # noqa: F401"""


def main() -> int:
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.origin:
        print("fix_torchvision: torchvision is not installed in this interpreter "
              f"({sys.executable}); install torchvision==0.28.0 first", file=sys.stderr)
        return 2
    path = spec.origin
    text = open(path, encoding="utf-8").read()
    if MARKER in text:
        print(f"fix_torchvision: already applied to {path}")
        return 0
    if ORIGINAL not in text:
        print(f"fix_torchvision: {path} does not contain the expected import block; "
              "this script knows torchvision 0.28.0 only", file=sys.stderr)
        return 2
    new = text.replace(ORIGINAL, REPLACEMENT, 1)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        fh.write(new)
    os.replace(tmp, path)
    print(f"fix_torchvision: patched {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
