"""The import graph of helpers/ stays readable (issue 14): every import resolves, module-top imports form no
cycle, a function-level import says why it is lazy, the torch-free entry points stay torch-free, and no part of the
package imports a part above it in the layer order of DESIGN.md (issue 19)."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from support import ROOT

PKG = ROOT / "helpers"


def _modname(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_modname(p): p for p in PKG.rglob("*.py")}


def _resolve(path: Path, node: ast.ImportFrom) -> str:
    mod = _modname(path)
    pkg = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
    if not node.level:
        return node.module or ""
    base = pkg[: len(pkg) - (node.level - 1)] if node.level > 1 else pkg
    return ".".join(base + ([node.module] if node.module else []))


def _top_nodes(tree: ast.Module):
    for n in tree.body:
        yield from (ast.walk(n) if isinstance(n, (ast.If, ast.Try)) else [n])


def _graph() -> dict[str, set[str]]:
    graph = {}
    for mod, path in MODULES.items():
        deps = set()
        for n in _top_nodes(ast.parse(path.read_text())):
            if isinstance(n, ast.ImportFrom):
                target = _resolve(path, n)
                if target in MODULES:
                    deps.add(target)
                deps |= {f"{target}.{a.name}" for a in n.names if f"{target}.{a.name}" in MODULES}
            elif isinstance(n, ast.Import):
                deps |= {a.name for a in n.names if a.name in MODULES}
        graph[mod] = deps
    return graph


#: The layer order of DESIGN.md "Layers", bottom first: a part (a subpackage, or a top-level module) imports only parts
#: of lower tiers, never one of its own tier or above (lazy imports included).
LAYERS = (
    ("__init__", "errors", "paths", "redaction", "kinds", "faults", "layers"),
    ("budget", "runfiles", "records"),
    ("formats", "hooks", "plots"),
    ("server", "trace_hooks"),
    ("diagnosis", "acceptance"),
    ("draft", "capture"),
    ("engines",),
    ("investigation",),
    ("views", "suite"),
    ("cli",),
    ("__main__",),
)


def _part(mod: str) -> str:
    """``helpers.diagnosis.static`` -> ``diagnosis``; ``helpers.runfiles`` -> ``runfiles``; ``helpers`` ->
    ``__init__``."""
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _part_imports() -> list[tuple[str, str, str, int]]:
    """Every import of one part of helpers by another, at module top or in a function: (part, imported part, module,
    line)."""
    out = []
    for mod, path in MODULES.items():
        for n in ast.walk(ast.parse(path.read_text())):
            if isinstance(n, ast.ImportFrom):
                base = _resolve(path, n)
                targets = [base] + [f"{base}.{a.name}" for a in n.names]
            elif isinstance(n, ast.Import):
                targets = [a.name for a in n.names]
            else:
                continue
            for target in targets:
                if target in MODULES and _part(target) != _part(mod):
                    out.append((_part(mod), _part(target), mod, n.lineno))
    return out


def _upward_imports(tier: dict[str, int]) -> list[str]:
    bad = []
    for part, dep, mod, line in _part_imports():
        if part not in tier or dep not in tier:
            bad.append(f"{mod}:{line}: part {part if part not in tier else dep} has no tier in LAYERS (DESIGN.md)")
        elif tier[dep] >= tier[part]:
            bad.append(f"{mod}:{line}: {part} (tier {tier[part]}) imports {dep} (tier {tier[dep]}), which is not "
                       "below it")
    return sorted(set(bad))


def test_no_part_imports_one_above_it():
    tier = {part: i for i, parts in enumerate(LAYERS) for part in parts}
    assert not _upward_imports(tier), "imports against the layer order:\n" + "\n".join(_upward_imports(tier))


def test_the_layer_check_sees_an_upward_import():
    """The check above is not vacuous: with the layer vocabulary moved up to server's tier, formats' real import of it
    is flagged; with server moved up to diagnosis's tier, diagnosis' real import of server is."""
    tier = {part: i for i, parts in enumerate(LAYERS) for part in parts}
    assert any("formats" in b and "imports layers" in b for b in _upward_imports({**tier, "layers": tier["server"]}))
    assert any("imports server" in b for b in _upward_imports({**tier, "server": tier["diagnosis"]}))


def test_every_helpers_import_resolves():
    bad = []
    for mod, path in MODULES.items():
        for n in ast.walk(ast.parse(path.read_text())):
            if not isinstance(n, ast.ImportFrom) or not (n.level or (n.module or "").startswith("helpers")):
                continue
            target = _resolve(path, n)
            if target not in MODULES:
                bad.append(f"{mod}:{n.lineno} imports missing module {target}")
                continue
            text = MODULES[target].read_text()
            for a in n.names:
                if f"{target}.{a.name}" not in MODULES and a.name not in text:
                    bad.append(f"{mod}:{n.lineno} imports missing name {target}.{a.name}")
    assert not bad, "\n".join(bad)


def test_module_top_imports_have_no_cycle():
    graph = _graph()
    state: dict[str, int] = {}
    cycles = []

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                cycles.append(" -> ".join(stack[stack.index(d):] + [d]))
            elif d not in state:
                visit(d, stack + [d])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_function_level_imports_say_why_they_are_lazy():
    bad = []
    for mod, path in MODULES.items():
        src = path.read_text()
        tree = ast.parse(src)
        top = {id(n) for n in _top_nodes(tree)}
        lines = src.splitlines()
        for n in ast.walk(tree):
            if not isinstance(n, (ast.Import, ast.ImportFrom)) or id(n) in top:
                continue
            said = "# lazy:" in lines[n.lineno - 2] + "".join(lines[n.lineno - 1:n.end_lineno])
            if not said:
                bad.append(f"{mod}:{n.lineno}: {lines[n.lineno - 1].strip()}")
    assert not bad, "function-level imports without a '# lazy: why' comment:\n" + "\n".join(bad)


@pytest.mark.parametrize("module", ["helpers.investigation.cases", "helpers.acceptance.measure",
                                    "helpers.server.client", "helpers.suite.params", "helpers.cli.measure",
                                    "helpers.diagnosis.sglang_rules", "helpers.layers.sglang",
                                    "helpers.formats.configs"])
def test_light_entry_points_do_not_import_torch(module):
    """A case file validates, a measurement runs and a config is read without loading torch (seconds of
    start-up on every command)."""
    code = f"import sys, {module}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"


def test_modules_and_orchestrator_functions_stay_small():
    """No module of helpers/ over 800 lines; no function of helpers/investigation/ (the orchestrators: investigate,
    ablate, the budget's live inputs, the proposed fix) over 120 lines: a long orchestrator grows into named stages."""
    import ast
    big_modules, big_functions = [], []
    for p in sorted((ROOT / "helpers").rglob("*.py")):
        text = p.read_text()
        if text.count("\n") > 800:
            big_modules.append(f"{p.relative_to(ROOT)}: {text.count(chr(10))} lines")
        if p.parent.name != "investigation":
            continue
        for n in ast.walk(ast.parse(text)):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > 120:
                big_functions.append(f"{p.relative_to(ROOT)}::{n.name}: {n.end_lineno - n.lineno + 1} lines")
    assert not big_modules and not big_functions, big_modules + big_functions
