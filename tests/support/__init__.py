"""Shared test helpers (tiny models, diagnosis cases, realistic data, headless browser, hostile inputs) and the test
tree's paths."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

#: the repository root (pyproject.toml, helpers/, env/, notebooks/)
ROOT = Path(__file__).resolve().parents[2]
#: tests/data: data files the tests read
DATA = ROOT / "tests" / "data"


def import_from(folder: Path, name: str) -> ModuleType:
    """Import the package ``folder/name/`` or the module ``folder/name.py`` as the top-level module ``name``
    (e.g. ``e3f_models`` from env/models), without adding ``folder`` to the import path for every other
    test. A package's submodules then import as usual (``from name import sub``)."""
    if name in sys.modules:
        return sys.modules[name]
    path = Path(folder) / name
    if path.is_dir():
        spec = importlib.util.spec_from_file_location(name, path / "__init__.py",
                                                      submodule_search_locations=[str(path)])
    else:
        spec = importlib.util.spec_from_file_location(name, path.with_name(name + ".py"))
    if spec is None or spec.loader is None:
        raise ImportError(f"no package or module {name!r} in {folder}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


def alias_bomb(levels: int = 9, indent: str = "") -> str:
    """YAML of ``levels`` lines that expand to 9 ** levels strings through aliases (a "billion laughs")."""
    lines = [f'{indent}a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    prev = "a"
    for n in "bcdefghijk"[:levels - 1]:
        lines.append(f"{indent}{n}: &{n} [" + ",".join([f"*{prev}"] * 9) + "]")
        prev = n
    return "\n".join(lines) + "\n"
