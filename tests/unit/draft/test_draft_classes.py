"""The draft-class registry (helpers.draft.params.DRAFT_CLASSES): one entry per SGLang EAGLE-3 draft class, each with
its attention adapter, and every source it cites names a file and class that SGLang 0.5.23 ships."""
from __future__ import annotations

import re

import pytest

from helpers.draft.attention import ATTENTIONS
from helpers.draft.params import DRAFT_CLASSES, LLAMA_CLASS, draft_class
from support import ROOT

SITE = next(iter(sorted((ROOT / "env" / "reference" / ".venv" / "lib").glob("python3*/site-packages"))), None)


def test_every_draft_class_has_its_attention_adapter_and_back():
    assert set(DRAFT_CLASSES) == set(ATTENTIONS)
    for name, dc in DRAFT_CLASSES.items():
        assert dc.name == name and ATTENTIONS[name].architecture == name


def test_an_unregistered_class_is_mirrored_as_the_llama_class():
    assert draft_class("NoSuchEagle3") is DRAFT_CLASSES[LLAMA_CLASS]


@pytest.mark.skipif(SITE is None or not (SITE / "sglang").is_dir(), reason="env/reference/.venv (sglang) not installed")
def test_each_cited_source_is_a_file_sglang_ships_defining_the_class():
    for dc in DRAFT_CLASSES.values():
        src = (SITE / dc.module).read_text()
        assert re.search(rf"^class {dc.name}\b", src, re.M), (dc.module, dc.name)
        for text in (dc.lm_head_build, dc.load_skips, dc.unexpected_weight, dc.rope_read):
            path = text.split("::")[0].split(" ")[0]
            assert (SITE / path).is_file(), text
            fn = re.match(r"[^:]+::(\w+)", text)
            if fn:
                assert re.search(rf"\b{fn.group(1)}\b", (SITE / path).read_text()), text
