"""``investigate`` on the embedded vLLM 0.32.0 server drafting with an EAGLE-1 draft (``method: eagle``): the
single-state stages (helpers/investigation/single_state.py EAGLE1 through helpers/investigation/mtp.py), live. Two
server starts, both extended (CI has no room):

* the trained EAGLE-1 draft as it ships: the served state is ``norm(out(n-1))`` (what vLLM hands
  ``drafter.propose``), the draft stage matches its training log on the log's own rows, the wiring and engine losses
  are clear: verdict ``ok``;
* the same draft with its ``fc`` halves swapped (``support.eagle1_faults``, a conversion that concatenated the other
  way round): named at the draft stage (``draft_underperforms``, cause ``draft``), the wiring still right.

The residual dropped by the engine and the pre-norm state fed have no vLLM hook here: they are run offline
(tests/unit/investigation/test_eagle1_stages.py, bench/bench_eagle1_faults.py)."""
from __future__ import annotations

import pytest

from helpers.engines.vllm_server import vllm_python
from helpers.investigation.live import investigate
from helpers.investigation.mtp import POST_NORM
from support.eagle1_faults import DRAFT, Eagle1Fault, write_faulty_draft
from test_vllm_faults import registry, server  # noqa: F401  (the module's registry fixture, its server start)

pytestmark = [pytest.mark.server, pytest.mark.vllm, pytest.mark.extended]
if not vllm_python().exists():
    pytest.skip("env/vllm/.venv is missing (make setup without SKIP_VLLM=1)", allow_module_level=True)
KW = dict(training=None, apply_fix=False, measure_prompts=12, max_new_tokens=32, sweeps=(), engine_probes="none")


def test_clean_eagle1_server_is_ok(tmp_path):
    # 240 s at load ~15-20 on 2 cores (server start ~140 s, investigate ~40 s)
    with server(DRAFT) as url:
        doc = investigate(url, run_dir=tmp_path / "run", **KW)
    print(doc.verdict, doc.seconds_to_verdict, doc.sentence)            # the figures docs/vllm.md quotes (-s)
    assert doc.diagnosis["kind"] == "eagle1" and doc.acceptance["kind"] == "eagle1"
    ident = doc.diagnosis["served_state"]
    assert ident["matches"] and ident["best"] == POST_NORM and ident["engine"] == "vLLM"
    losses = doc.acceptance["losses"]
    assert losses["draft"]["decision"] == "clear", losses["draft"]
    assert doc.verdict == "ok" and not doc.findings, (doc.verdict, [f.kind for f in doc.findings], losses)
    assert "the EAGLE-1 draft is fed norm(out(n-1))" in doc.sentence and "as vLLM does" in doc.sentence
    from helpers.views.investigation import page_html  # lazy: plotly, only for this page
    assert "<title>EAGLE-1 draft live investigation" in page_html(doc)


def test_fc_halves_swapped_are_named_at_the_draft_stage(tmp_path):
    # 227 s at load ~15-20 on 2 cores
    folder = write_faulty_draft(Eagle1Fault(1, "fc_swap"), tmp_path / "draft")
    with server(folder) as url:
        doc = investigate(url, run_dir=tmp_path / "run", **KW)
    print(doc.verdict, doc.seconds_to_verdict, doc.sentence)            # the figures docs/vllm.md quotes (-s)
    kinds = [f.kind for f in doc.findings]
    b = doc.acceptance
    assert doc.verdict == "mismatch" and kinds == ["draft_underperforms"], (kinds, b["sentence"])
    assert b["cause"] == "draft" and b["losses"]["draft"]["decision"] == "counts"
    assert doc.diagnosis["served_state"]["matches"]                       # the wiring is right: not named there
    assert doc.sentence.startswith("The EAGLE-1 draft scores below its training log"), doc.sentence
