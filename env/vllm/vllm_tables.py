"""Where vLLM's EAGLE-3 rules live, release by release, read mechanically from a folder of vLLM sdists.

Usage: ``python env/vllm/vllm_tables.py /tmp/vllm-sdists [--out FILE] [--show RULE]``. The folder holds one
sub-folder per release (``0.12.0/vllm-0.12.0/vllm/...``, extracted sdists from PyPI; nothing is installed or
imported). For every rule of ``helpers/layers/vllm.py::SOURCES`` it finds the functions that implement it (by
name, with ``ast``), records ``file::Class.function`` and a digest of the function's AST (line numbers and
docstrings left out), and groups releases into ranges where the digest holds. It also records the default aux
layer ids expression (the ``return`` of the default-layers function) and whether the ids are sorted / deduplicated
where they are set. A change of digest is a *candidate* rule change: the range boundaries were then read by hand
(``--show RULE`` prints the bodies at each boundary) and the verdicts are in
``helpers/layers/data/vllm-eagle3-releases.json``.
"""
from __future__ import annotations

import argparse
import ast
import hashlib
import json
import re
import sys
from pathlib import Path

#: rule -> function names that implement it (any of them, first found wins per file)
RULE_FUNCS = {
    "aux_ids": ["_get_eagle3_aux_layers_from_config", "get_eagle3_aux_layer_ids_from_config"],
    "aux_default": ["get_eagle3_default_aux_hidden_state_layers", "get_eagle3_aux_hidden_state_layers"],
    "aux_set": ["_set_aux_hidden_state_layers", "set_aux_hidden_state_layers"],
    "aux_capture": ["_maybe_add_hidden_state"],
    "use_aux": ["_get_eagle3_use_aux_hidden_state_from_config"],
    "embed_share": ["_maybe_share_embeddings"],
    "lm_head_share": ["_maybe_share_lm_head"],
    "own_weights": ["process_eagle_weight"],
    "speculators": ["update_eagle3"],
    "d2t": ["load_weights", "compute_logits"],
}
#: files searched per rule (relative to the package root ``vllm/``)
RULE_FILES = {
    "aux_ids": ["v1/worker/gpu_model_runner.py", "v1/worker/gpu/spec_decode/eagle/eagle3_utils.py"],
    "aux_default": ["model_executor/models/interfaces.py", "model_executor/models/llama.py"],
    "aux_set": ["model_executor/models/interfaces.py", "model_executor/models/llama.py"],
    "aux_capture": ["model_executor/models/interfaces.py", "model_executor/models/llama.py"],
    "use_aux": ["v1/spec_decode/llm_base_proposer.py", "v1/spec_decode/eagle.py"],
    "embed_share": ["v1/spec_decode/llm_base_proposer.py", "v1/spec_decode/eagle.py"],
    "lm_head_share": ["v1/spec_decode/llm_base_proposer.py", "v1/spec_decode/eagle.py"],
    "own_weights": ["model_executor/models/utils.py"],
    "speculators": ["transformers_utils/configs/speculators/algos.py"],
    "d2t": ["model_executor/models/llama_eagle3.py"],
}


def vkey(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", v))


def _strip_doc(fn: ast.AST) -> ast.AST:
    body = getattr(fn, "body", [])
    if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) \
            and isinstance(body[0].value.value, str):
        fn.body = body[1:]
    return fn


def find_functions(path: Path, names: list[str]) -> list[tuple[str, ast.FunctionDef, str]]:
    """(qualified name, node, source segment) of every def named in ``names`` in ``path`` (classes included)."""
    if not path.is_file():
        return []
    src = path.read_text(errors="replace")
    tree = ast.parse(src)
    out = []

    def walk(node, prefix):
        for ch in ast.iter_child_nodes(node):
            if isinstance(ch, ast.ClassDef):
                walk(ch, prefix + ch.name + ".")
            elif isinstance(ch, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if ch.name in names:
                    out.append((prefix + ch.name, ch, ast.get_source_segment(src, ch) or ""))
    walk(tree, "")
    return out


def digest(node: ast.AST) -> str:
    return hashlib.sha1(ast.dump(_strip_doc(node), include_attributes=False).encode()).hexdigest()[:10]


def default_expr(seg: str) -> str | None:
    """The default ids expression: the tuple returned by the default-layers function."""
    m = re.search(r"return\s*\(\s*(2\s*,[^\n]*?)\)\s*$", seg, re.M)
    return re.sub(r"\s+", " ", m.group(1)).strip() if m else None


def read_release(root: Path) -> dict:
    pkg = next(root.glob("vllm-*/vllm"), None)
    if pkg is None:
        raise SystemExit(f"{root}: no vllm-*/vllm package folder (expected an extracted sdist)")
    rel: dict = {}
    for rule, names in RULE_FUNCS.items():
        found = []
        for f in RULE_FILES[rule]:
            for q, node, seg in find_functions(pkg / f, names):
                item = {"where": f"vllm/{f}::{q}", "digest": digest(node)}
                if rule == "aux_default":
                    item["default"] = default_expr(seg)
                if rule == "aux_set":
                    item["sorted"] = "sorted(" in seg
                    item["dedup"] = "set(" in seg
                found.append(item)
        rel[rule] = found
    return rel


def ranges(releases: dict[str, dict], rule: str) -> list[dict]:
    """Consecutive releases with the same (where, digest) list for ``rule``."""
    out: list[dict] = []
    for v in sorted(releases, key=vkey):
        sig = [(i["where"], i["digest"]) for i in releases[v][rule]]
        if out and out[-1]["sig"] == sig:
            out[-1]["last"] = v
        else:
            out.append({"first": v, "last": v, "sig": sig, "items": releases[v][rule]})
    for r in out:
        r.pop("sig")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--show", help="print the function bodies of RULE at each range start")
    a = ap.parse_args(argv)
    rels = {d.name: read_release(d) for d in a.folder.iterdir() if d.is_dir() and re.match(r"\d+\.\d+", d.name)}
    if not rels:
        raise SystemExit(f"{a.folder}: no release folders (expected e.g. 0.12.0/vllm-0.12.0/vllm)")
    table = {"releases_read": sorted(rels, key=vkey),
             "mechanical": {rule: ranges(rels, rule) for rule in RULE_FUNCS}}
    if a.show:
        for r in table["mechanical"][a.show]:
            v = r["first"]
            pkg = next((a.folder / v).glob("vllm-*/vllm"))
            print(f"===== {a.show} {r['first']} .. {r['last']}")
            for f in RULE_FILES[a.show]:
                for q, node, seg in find_functions(pkg / f, RULE_FUNCS[a.show]):
                    print(f"--- vllm/{f}::{q}\n{seg}")
        return 0
    text = json.dumps(table, indent=1)
    if a.out:
        a.out.write_text(text + "\n")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
