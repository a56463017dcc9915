"""investigate's plan-identification step (helpers.investigation.identify.identify_stage) without training data, on
the shipped reference pair: the "server" is HF transformers on the target (a fake engine adapter whose continuations
the target samples itself, seeded), its every-layer reference HF's own, the identification the real one. Few and short
continuations leave the plan undecided after both rounds: the record of an undecided step is what is tested."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from helpers.budget import Budget
from helpers.draft.plan_id import PROVENANCE, UNDECIDED_PROVENANCE, reference_from_hf
from helpers.engines.base import Continuation
from helpers.engines.sglang import SGLangAdapter
from helpers.errors import BadInput
from helpers.formats.configs import read_target_config
from helpers.investigation import identify
from helpers.investigation.attach import Attachment
from helpers.investigation.live import Request, Run
from helpers.records import InvestigationDoc
from support import ROOT

TARGET, DRAFT = ROOT / "env" / "models" / "target", ROOT / "env" / "models" / "draft"


class _HFServer(SGLangAdapter):
    """Continuations sampled by the target itself (HF, temperature 1, the request's seed); no every-layer capture of
    its own, so the step takes HF's reference as it does for a server without capture hooks."""

    def __init__(self):
        from transformers import AutoTokenizer
        self.tok, self.calls = AutoTokenizer.from_pretrained(str(TARGET)), []

    def continuations(self, client, prompts, *, max_new_tokens, sampling, concurrency, timeout_s):
        self.calls.append(len(prompts))
        out = []
        for j, p in enumerate(prompts):
            ids = self.tok(p.text)["input_ids"]
            x = reference_from_hf(TARGET, [ids], new_tokens=max_new_tokens, temperature=1.0,
                                  seed=int(sampling["sampling_seed"]) + j)[0]
            out.append(Continuation(p.id, tuple(ids), tuple(int(t) for t in x.tokens[len(ids):])))
        return out

    def every_layer_source(self, client, layers_dir):
        return None


def test_an_undecided_identification_records_both_rounds_its_wall_time_and_names_no_plan(tmp_path, monkeypatch):
    monkeypatch.setattr(identify, "IDENTIFY_PROMPTS", 2)
    monkeypatch.setattr(identify, "IDENTIFY_TOKENS", 8)
    req = Request(url="http://hf.test:1", training=None, run_dir=tmp_path)
    (tmp_path / "dumps").mkdir()
    said: list = []
    r = Run(req=req, doc=InvestigationDoc(url=req.url, run_dir=str(tmp_path), training=""), dl=Budget(None),
            progress=said.append)
    r.adapter, r.client = _HFServer(), SimpleNamespace(generate_timeout=60.0)
    r.att = Attachment(url=req.url, version="0.5.23", tp=1, algorithm="EAGLE3", spec={}, served_draft=str(DRAFT),
                       served_target=str(TARGET), draft_dir=DRAFT, draft_source="server", target_dir=TARGET,
                       target_source="server")
    r.tcfg = read_target_config(TARGET)
    with pytest.raises(BadInput) as e:
        identify.identify_stage(r)
    msg = str(e.value)
    assert "undecided" in msg and UNDECIDED_PROVENANCE in msg and PROVENANCE not in msg
    assert r.adapter.calls == [2, 2]                                   # two rounds of continuations were asked for
    doc = json.loads((tmp_path / "plan_identification.json").read_text())
    assert doc["decision"] == "undecided" and doc["rounds"] == 2 and doc["sequences"] == 4
    assert doc["provenance"] == UNDECIDED_PROVENANCE and PROVENANCE not in doc["sentence"]
    assert isinstance(doc["search_rounds"], int) and 0 < doc["offline_seconds"] < doc["seconds"]
    # the step's wall time is recorded although it raised, and covers what plan_identification.json says
    assert r.timings["plan identification"] >= doc["seconds"]
    assert req.training is None and r.doc.training == ""
