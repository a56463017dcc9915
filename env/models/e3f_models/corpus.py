"""Offline English corpus for the reference target: docstrings and docs shipped with Python.

Sources (nothing is downloaded):
  * docstrings of every module / class / function in the running interpreter's standard library
    (``sysconfig.get_paths()["stdlib"]``, tests and site-packages excluded), read with ``ast`` so
    that no module is imported;
  * docstrings and ``.rst`` / ``.md`` / ``.txt`` files of a fixed list of installed packages
    (``PACKAGES``) in the suite environment's site-packages.

Paragraphs are cleaned into prose (code examples, reST directives, tables and headings are dropped;
line breaks inside a paragraph are joined) and deduplicated; each source file becomes one document
(its docstrings in source order), and documents are split into train / held-out by a hash of the
text, so the split does not depend on file order. Everything is deterministic for a
given set of installed files; ``corpus_manifest`` records a sha256 of the result so a regeneration on
another machine can tell whether it saw the same text.
"""
from __future__ import annotations

import ast
import hashlib
import os
import re
import sysconfig
from dataclasses import dataclass
from pathlib import Path

# Packages of the suite environment whose docs are prose-heavy. plotly (generated parameter docs),
# sympy/mpmath (formulae) and vendored trees are left out on purpose.
PACKAGES = ("numpy", "pandas", "torch", "transformers", "networkx", "huggingface_hub", "IPython",
            "pip", "setuptools", "tornado", "pydantic", "_pytest", "jinja2", "nbformat", "nbconvert",
            "jupyter_client", "traitlets", "tqdm", "safetensors", "tokenizers", "papermill",
            "jsonschema", "yaml", "psutil", "httpx", "dateutil", "fsspec", "filelock")
DOC_SUFFIXES = (".rst", ".md", ".txt")
SKIP_DOC_NAMES = re.compile(r"(licen[cs]e|copying|authors|requirements|top_level|entry_points|"
                            r"dependency_links|record|installer|sources|not-zip-safe|namespace)",
                            re.I)
SKIP_DIR_PARTS = {"test", "tests", "testing", "_vendor", "vendor", "idlelib", "lib2to3",
                  "site-packages", "__pycache__", "turtledemo", "ensurepip"}


def _paragraph_ok(p: str) -> bool:
    """True for a paragraph that reads as English prose (not code, tables or reST markup)."""
    if len(p) < 40:
        return False
    first = p.lstrip()[:4]
    if first.startswith((">>>", "...", ".. ", "::", "$ ", "#", "|", "+-", "==", "--", "{", "[",
                         "<", "`", "*", "-", "@")):
        return False
    words = p.split()
    if len(words) < 6:
        return False
    alpha_words = sum(1 for w in words if re.fullmatch(r"[A-Za-z][a-z'-]*[.,;:!?)]?", w))
    if alpha_words / len(words) < 0.7:
        return False
    letters = sum(c.isalpha() or c == " " for c in p)
    if letters / len(p) < 0.85:
        return False
    if not re.search(r"[.!?:]$", p):  # complete sentence(s) only
        return False
    return True


def clean_text(text: str) -> list[str]:
    """Split raw docstring / doc-file text into cleaned prose paragraphs (one line each)."""
    paras = re.split(r"\n\s*\n", text.replace("\r", ""))
    out = []
    for raw in paras:
        lines = [ln.strip() for ln in raw.split("\n")]
        # a paragraph with an indented / code-ish or underline line is not prose
        if any(re.fullmatch(r"[-=~^*#+`.:_]{3,}", ln) for ln in lines if ln):
            lines = [ln for ln in lines if not re.fullmatch(r"[-=~^*#+`.:_]{3,}", ln)]
            if len(lines) <= 1:
                continue
        p = " ".join(ln for ln in lines if ln)
        p = re.sub(r"\s+", " ", p).strip()
        # inline reST roles -> plain words: :func:`foo` -> foo, ``x`` -> x
        p = re.sub(r":[a-z]+(?::[a-z]+)?:`~?([^`]+)`", r"\1", p)
        p = p.replace("``", "").replace("`", "")
        if _paragraph_ok(p):
            out.append(p)
    return out


def _docstrings(path: Path) -> list[str]:
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
        return []
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            d = ast.get_docstring(node)
            if d:
                out.append((getattr(node, "lineno", 0), d))
    return [d for _, d in sorted(out, key=lambda x: x[0])]  # source order


def _walk(root: Path, want_docs: bool):
    for dp, dn, fn in os.walk(root):
        dn[:] = sorted(d for d in dn if d not in SKIP_DIR_PARTS)
        for f in sorted(fn):
            p = Path(dp) / f
            if f.endswith(".py"):
                yield p, "py"
            elif want_docs and f.endswith(DOC_SUFFIXES) and not SKIP_DOC_NAMES.search(f):
                yield p, "doc"


def source_roots() -> list[tuple[str, Path]]:
    """``[(name, dir)]`` of the corpus sources present in this interpreter, in a fixed order."""
    paths = sysconfig.get_paths()
    roots = [("stdlib", Path(paths["stdlib"]))]
    site = Path(paths["purelib"])
    for name in PACKAGES:
        if (site / name).is_dir():
            roots.append((name, site / name))
    return roots


@dataclass
class Corpus:
    train: list[str]       # documents (one source / doc file each; paragraphs joined by "\n")
    heldout: list[str]
    sources: list[str]     # names of the roots that were read
    sha256: str            # of the joined train + held-out text


def build_corpus(heldout_frac: float = 0.04, progress: bool = True) -> Corpus:
    """Read, clean, deduplicate and split the corpus (deterministic; ~1-2 min on 2 cores)."""
    from tqdm import tqdm

    seen_para: set[str] = set()
    docs: list[str] = []
    roots = source_roots()
    for name, root in tqdm(roots, desc="corpus sources", disable=not progress):
        for path, kind in _walk(root, want_docs=name != "stdlib"):
            # one document per file: all its docstrings (in source order) or the doc file's text,
            # so documents are long enough that greedy continuations rarely hit </s> at once
            texts = _docstrings(path) if kind == "py" else [_read(path)]
            paras = []
            for t in texts:
                for p in clean_text(t):
                    if p not in seen_para:  # dedupe repeated boilerplate paragraphs
                        seen_para.add(p)
                        paras.append(p)
            if paras:
                docs.append("\n".join(paras))
    train, held = [], []
    for d in docs:
        h = int(hashlib.sha256(d.encode()).hexdigest()[:8], 16)
        (held if (h % 10000) < heldout_frac * 10000 else train).append(d)
    digest = hashlib.sha256("\x00".join(train + ["\x01"] + held).encode()).hexdigest()
    return Corpus(train=train, heldout=held, sources=[n for n, _ in roots], sha256=digest)


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return ""
