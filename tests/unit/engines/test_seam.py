"""One seam, not branches: code above helpers/engines/ never asks which engine it runs for (it calls the adapter the
server was detected as), and every adapter keeps the whole contract."""
from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from helpers.engines.base import EngineAdapter
from helpers.engines.detect import ADAPTERS

ROOT = Path(__file__).resolve().parents[3]
#: a comparison with an engine name, or a type test on an engine's class
BRANCH = re.compile(r"""(\bengine\w*\s*(==|!=)\s*["'])|((==|!=)\s*["'](vllm|sglang)["'])|(["'](vllm|sglang)["']\s*(==|!=))"""
                    r"""|(isinstance\([^)]*\b(VLLM|SGLang)(Adapter|Client)\b)""")
#: the one allowed line: served_plan refuses another engine's name (a refusal, not a branch: it serves one engine)
ALLOWED = {("helpers/diagnosis/conventions.py", 'if engine != "sglang":')}


def _files():
    for p in sorted((ROOT / "helpers").rglob("*.py")):
        if "engines" not in p.relative_to(ROOT / "helpers").parts:
            yield p
    yield from sorted((ROOT / "notebooks").glob("*.py"))


def test_no_engine_branch_outside_the_engines_package():
    hits = []
    for p in _files():
        rel = str(p.relative_to(ROOT))
        for n, line in enumerate(p.read_text().splitlines(), 1):
            if BRANCH.search(line) and (rel, line.strip()) not in ALLOWED:
                hits.append(f"{rel}:{n}: {line.strip()}")
    assert not hits, "engine branches outside helpers/engines/ (go through the adapter):\n" + "\n".join(hits)


def test_the_pattern_catches_what_it_is_for():
    for line in ('if engine == "vllm":', "if args.engine == 'vllm':", 'x = "sglang" != name',
                 "if isinstance(client, VLLMClient):", 'elif info["engine"] != "sglang":'):
        assert BRANCH.search(line), line
    assert not BRANCH.search("adapter = engine_adapter(name)")


@pytest.mark.parametrize("cls", ADAPTERS, ids=lambda c: c.name)
def test_every_adapter_keeps_the_whole_contract(cls):
    abstract = {n for n, v in vars(EngineAdapter).items() if getattr(v, "__isabstractmethod__", False)}
    assert abstract and not getattr(cls, "__abstractmethods__", set())
    a = cls()
    for name in abstract:
        own = inspect.signature(getattr(cls, name))
        base = inspect.signature(getattr(EngineAdapter, name))
        # the contract's keyword arguments are accepted by every adapter
        kw = {p for p, v in base.parameters.items() if v.kind is v.KEYWORD_ONLY}
        has_var = any(v.kind is v.VAR_KEYWORD for v in own.parameters.values())
        assert has_var or kw <= set(own.parameters), (cls.name, name, kw - set(own.parameters))
    assert a.rules("1.0").engine == a.name and a.toggles()
