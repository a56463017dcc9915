"""Derive the EAGLE-3 capture table of an installed SGLang from its source (no import of SGLang needed).

    python env/reference/sglang_tables.py [--sglang DIR] [--out helpers/layers/data/sglang-<version>-eagle3.json]

For every model class SGLang registers (``EntryClass`` of ``sglang/srt/models/*.py``, the registry
``sglang/srt/models/registry.py`` imports) it records which ``set_eagle3_layers_to_capture`` the class has
(its own or inherited, by class name across the models package) and classifies that method's id rule by
reading its body:

* ``plus_one``          ``[val + 1 for val in layer_ids]`` (``models/llama.py`` and most others);
* ``deepseek``          +1 only ``if layer_ids and layer_ids[0] == 1`` (``models/deepseek_v2.py``, PR 25454);
* ``gpt_oss``           ids kept when ``max(layer_ids) == num_layers`` (final boundary), else +1 (``models/gpt_oss.py``);
* ``per_layer_flag``    +1, then ``self.layers[layer_id]`` is flagged (``qwen2_moe.py`` / ``qwen3_moe.py`` ...):
                        an id of n-1 indexes ``layers[n]`` -> IndexError at start-up;

and, as ``last_layer``, what capture index n (an id naming the last layer, after +1) does: ``missing`` (the loop
never reaches it: the chunk is silently absent), ``index_error``, ``boundary`` (the model's forward captures the last
layer's output after the loop: ``gpt_oss.py``, ``gemma3_causal.py``, ``gemma4_causal.py``, ``minimax_m3.py``), or
``runtime_error`` (the captures go into an ``AuxHiddenStatePacker`` sized by the ids, whose ``finalize`` raises
RuntimeError at the first forward when one is never reached: ``deepseek_v2.py``, and Kimi-K2.5 through it);
* ``plus_one_default``  +1 applied to the default ids too (``models/minimax_m3_vl.py``);
* ``none``              no such method: ``attention_backend_setup.py::configure_aux_hidden_state_capture``
                        raises ValueError, the server refuses EAGLE-3.

and the EAGLE-3 draft classes (``EntryClass`` of ``models/*eagle3*.py``). The output is this project's table
of facts (class names, file names, rule names), not SGLang code; ``tests/unit/diagnosis/test_diag_sglang_rules.py`` checks it
against the installed package when ``env/reference/.venv`` exists.
"""
from __future__ import annotations

import argparse
import ast
import json
import re
from pathlib import Path


def _norm(src: str) -> str:
    return re.sub(r"\s+", " ", src)


def _id_rule(body: str) -> str | None:
    """The id rule a method body states itself, or None when it forwards the ids unchanged."""
    if "layer_ids[0] == 1" in body:
        return "deepseek"
    if re.search(r"max\(layer_ids\) == (num_layers|self\.config\.num_hidden_layers)", body):
        return "gpt_oss"
    if re.search(r"if layer_ids is None: (num_layers = [^:]*? )?layer_ids = \[", body) and "val + 1 for val in layer_ids" in body:
        return "plus_one_default"
    if "val + 1 for val in layer_ids" in body:
        return "plus_one"
    return None


def build(models: Path) -> dict:
    files = {}
    for f in sorted(models.glob("*.py")):
        try:
            text = f.read_text(encoding="utf-8")
            files[f.name] = (ast.parse(text), text)
        except SyntaxError:
            continue
    classes: dict[str, tuple[str, ast.ClassDef]] = {}
    for name, (tree, _) in files.items():
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                classes.setdefault(node.name, (name, node))

    def bases(node: ast.ClassDef) -> list[str]:
        return [b.id if isinstance(b, ast.Name) else b.attr for b in node.bases if isinstance(b, (ast.Name, ast.Attribute))]

    def method(cls: str, name: str = "set_eagle3_layers_to_capture", seen=()) -> tuple[str, str, str] | None:
        """(file, class, source) of the method as ``cls`` resolves it (own or inherited)."""
        if cls not in classes or cls in seen:
            return None
        fname, node = classes[cls]
        for f in node.body:
            if isinstance(f, ast.FunctionDef) and f.name == name:
                return fname, cls, ast.get_source_segment(files[fname][1], f) or ""
        for b in bases(node):
            r = method(b, name, seen + (cls,))
            if r:
                return r
        return None

    def attr_classes(cls: str, attr: str) -> list[str]:
        """Classes assigned to ``self.<attr>`` in ``cls``'s (or a base's) ``__init__``: ``self.attr = C(...)``."""
        init = method(cls, "__init__")
        if init is None:
            return []
        return [c for c in re.findall(rf"self\.{attr}\s*=\s*([A-Z]\w+)\(", init[2]) if c in classes]

    def analyse(cls: str, depth: int = 0) -> dict:
        m = method(cls)
        if m is None:
            return {"rule": "none", "method_in": None, "last_layer": None}
        fname, owner, src = m
        body = _norm(src)
        where = f"sglang/srt/models/{fname}::{owner}.set_eagle3_layers_to_capture"
        rule = _id_rule(body)
        last = "missing"
        if "_is_layer_to_capture" in body:
            last = "missing" if re.search(r"0 <= layer_id < len|layer_id < len", body) else "index_error"
        if rule == "gpt_oss":
            last = "boundary"
        inner = re.findall(r"self\.(\w+)\.set_eagle3_layers_to_capture\(", body)
        for attr in inner:
            for c in attr_classes(owner, attr) or ([] if attr != "model" else []):
                if depth < 3:
                    sub = analyse(c, depth + 1)
                    if rule is None and sub["rule"] not in (None, "none"):
                        rule = sub["rule"]
                    if sub.get("last_layer") in ("index_error", "boundary"):
                        last = sub["last_layer"]
            if attr == "model" and owner in classes:
                # the inner model is built in __init__ under another name pattern: look at every class of the
                # file whose own set_eagle3_layers_to_capture flags layers (qwen2_moe.py, qwen3_5.py, ...)
                ftree = files[fname][0]
                for node in ftree.body:
                    if isinstance(node, ast.ClassDef) and node.name != owner:
                        mm = method(node.name)
                        if mm and "_is_layer_to_capture" in _norm(mm[2]) and "val + 1" not in _norm(mm[2]):
                            if not re.search(r"layer_id < len", _norm(mm[2])):
                                last = "index_error"
        # models whose forward captures the last layer's output after the loop (capture index n):
        # gemma3/gemma4 (``if num_layers in self.layers_to_capture``), minimax_m3 (``self.end_layer in ...``)
        inner = [owner] + [c for attr in ("model", "language_model") for c in attr_classes(owner, attr)]
        for c in inner:
            fwd = method(c, "forward")
            if fwd and re.search(r"(num_layers|self\.end_layer|len\(self\.layers\)) in self\.layers_to_capture",
                                 _norm(fwd[2])):
                last = "boundary"
        if last == "missing" and "hasattr(self.model, \"set_eagle3_layers_to_capture\")" in body:
            last = "unknown"   # depends on which text model the config builds (dense: missing; MoE: IndexError)
        # models that collect the captures into AuxHiddenStatePacker(len(layers_to_capture)) (deepseek_v2.py): an
        # index the loop never reaches leaves the packer short, and finalize() raises RuntimeError("captured k of m
        # aux hidden states") at the first forward (sglang/srt/layers/aux_hidden_states.py)
        if last == "missing" and _packs(owner):
            last = "runtime_error"
        return {"rule": rule or "plus_one", "method_in": where, "last_layer": last}

    def _packs(cls: str, depth: int = 0) -> bool:
        """Whether ``cls``'s forward, or that of the model it wraps (``self.model`` / ``self.language_model``, two
        levels), collects the aux captures into an ``AuxHiddenStatePacker``."""
        fwd = method(cls, "forward")
        if fwd and "AuxHiddenStatePacker(" in fwd[2]:
            return True
        return depth < 2 and any(_packs(c, depth + 1) for attr in ("model", "language_model")
                                 for c in attr_classes(cls, attr))

    def entry(tree: ast.Module) -> list[str]:
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "EntryClass" for t in node.targets):
                v = node.value
                elts = v.elts if isinstance(v, (ast.List, ast.Tuple)) else [v]
                return [e.id for e in elts if isinstance(e, ast.Name)]
        return []

    targets = {}
    drafts = []
    for fname, (tree, _) in files.items():
        for cls in entry(tree):
            if "eagle3" in fname:
                drafts.append({"architecture": cls, "file": f"sglang/srt/models/{fname}"})
            targets[cls] = {"file": f"sglang/srt/models/{fname}", **analyse(cls)}
    return {"targets": dict(sorted(targets.items())), "eagle3_drafts": sorted(drafts, key=lambda d: d["architecture"])}


def installed_version(pkg: Path) -> str:
    """The version pip installed (``sglang-<version>.dist-info`` next to the package)."""
    for d in pkg.parent.glob("sglang-*.dist-info"):
        for line in (d / "METADATA").read_text().splitlines():
            if line.startswith("Version:"):
                return line.split(":", 1)[1].strip()
    return re.search(r'__version__\s*=\s*"([^"]+)"', (pkg / "version.py").read_text()).group(1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sglang", help="the sglang package folder (default: env/reference/.venv's)")
    ap.add_argument("--out", help="output JSON (default: print)")
    a = ap.parse_args()
    root = Path(__file__).resolve().parents[2]
    pkg = Path(a.sglang) if a.sglang else next((root / "env/reference/.venv/lib").glob("python3*/site-packages/sglang"))
    version = installed_version(pkg)
    table = {"sglang_version": version, "generator": "env/reference/sglang_tables.py",
             "source": "sglang/srt/models/*.py (EntryClass, set_eagle3_layers_to_capture)", **build(pkg / "srt" / "models")}
    text = json.dumps(table, indent=1, sort_keys=False) + "\n"
    if a.out:
        Path(a.out).write_text(text)
        print(f"wrote {a.out}: {len(table['targets'])} architectures, {len(table['eagle3_drafts'])} EAGLE-3 drafts")
    else:
        print(text)


if __name__ == "__main__":
    main()
