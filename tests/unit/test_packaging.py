"""environment.yml (conda + pip section) and pyproject.toml list the same packages with the same
version specifiers."""
from __future__ import annotations

import re
import tomllib

import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from support import ROOT

#: conda-level entries that are the interpreter / installer, not project dependencies
CONDA_TOOLS = {"python", "pip"}


def _pyproject() -> dict[str, str]:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    out = {}
    for d in deps:
        r = Requirement(d)
        out[canonicalize_name(r.name)] = str(r.specifier)
    return out


def _conda_spec(entry: str) -> tuple[str, str]:
    """``name=1.2`` / ``name>=1.2`` / ``name`` (conda match spec) -> (name, pip-style specifier)."""
    m = re.fullmatch(r"\s*([A-Za-z0-9_.\-]+)\s*(.*)", entry)
    name, spec = m.group(1), m.group(2).strip()
    if re.fullmatch(r"=[^=<>!].*", spec):  # conda's "=1.2" means 1.2.*
        spec = f"=={spec[1:]}.*" if not spec.endswith("*") else f"=={spec[1:]}"
    return canonicalize_name(name), str(Requirement(f"x{spec}").specifier) if spec else ""


def _environment() -> tuple[dict[str, str], list[str]]:
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    out: dict[str, str] = {}
    pip_options = []
    for dep in env["dependencies"]:
        if isinstance(dep, dict):
            for p in dep["pip"]:
                if p.startswith("-"):
                    pip_options.append(p)
                    continue
                r = Requirement(p)
                out[canonicalize_name(r.name)] = str(r.specifier)
        else:
            name, spec = _conda_spec(dep)
            if name not in CONDA_TOOLS:
                out[name] = spec
    return out, pip_options


def test_environment_yml_matches_pyproject():
    py = _pyproject()
    env, _ = _environment()
    assert sorted(env) == sorted(py), (f"only in environment.yml: {sorted(set(env) - set(py))}; "
                                       f"only in pyproject.toml: {sorted(set(py) - set(env))}")
    differ = {k: (py[k], env[k]) for k in py if py[k] != env[k]}
    assert not differ, f"version specifiers differ (pyproject, environment.yml): {differ}"


def test_environment_yml_installs_this_project_and_cpu_torch():
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    _, options = _environment()
    assert "-e ." in options, "environment.yml must install this project (pip: -e .)"
    assert any("download.pytorch.org/whl/cpu" in o for o in options), "torch must come from the CPU index"
    conda = [d for d in env["dependencies"] if isinstance(d, str)]
    assert any(d.startswith("python") for d in conda) and "pip" in conda
