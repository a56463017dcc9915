"""The MTP weights faults on a live SGLang 0.5.23 NEXTN server at TP 1 (extended tier; two server starts):
``investigate`` names each in its stage (tests/support/mtp_faults.py WEIGHT_CLASSES).

* A head trained with its own lm_head (the first ``own_head`` ``trained`` ``head`` draw permuting over half of the
  units): SGLang serves the target's lm_head, so the draft stage counts the loss against the log and the weights
  check names ``lm_head_replaced``.
* The target with its whole NextN layer left out (the first ``missing`` ``layer`` draw): SGLang starts anyway; the
  weights check names ``mtp_weights_missing``, no acceptance budget runs (the offline head cannot reproduce the
  uninitialised parameters) and the verdict is ``mismatch``.
"""
from __future__ import annotations

import time
from itertools import count

import pytest

from helpers.server.embedded import start
from support.mtp_faults import VALIDATION, WEIGHT_CLASSES, draw, write_faulty_target

pytestmark = pytest.mark.extended

PROMPTS, NEW = 8, 24


def _first(pred):
    return next(f for f in (draw(s, WEIGHT_CLASSES) for s in count()) if pred(f))


def _run(folder, run_dir):
    from helpers.investigation.live import investigate
    from helpers.server.settings import SpecSettings
    t0 = time.monotonic()
    h = start(folder, None, tp=1, spec=SpecSettings(algorithm="NEXTN", num_steps=1, topk=1, num_draft_tokens=2),
              timeout=1200)
    print(f"\n[nextn weights] server ({folder}) ready in {time.monotonic() - t0:.1f} s")
    try:
        t0 = time.monotonic()
        doc = investigate(h.url, training=None, run_dir=run_dir, measure_prompts=PROMPTS, max_new_tokens=NEW,
                          timeout=900, apply_fix=False, engine_probes="none", validation=VALIDATION)
        print(f"[nextn weights] investigate: {time.monotonic() - t0:.1f} s; verdict {doc.verdict}; {doc.sentence}")
        return doc
    finally:
        h.stop()


def test_a_head_trained_with_its_own_lm_head_loses_in_the_draft_stage_and_is_named(tmp_path):
    f = _first(lambda f: f.kind == "own_head" and f.params["mode"] == "trained" and f.params["which"] == "head"
               and f.params["fraction"] > 0.5)
    doc = _run(write_faulty_target(f, tmp_path / "t"), tmp_path / "run")
    kinds = [x.kind for x in doc.findings]
    assert doc.verdict == "mismatch" and doc.error is None and "lm_head_replaced" in kinds
    d = doc.acceptance["losses"]["draft"]
    assert doc.acceptance["draft_stage"]["same_rows"] and d["decision"] == "counts", (f.label(), d)


def test_a_target_without_its_nextn_layer_is_served_and_named(tmp_path):
    f = _first(lambda f: f.kind == "missing" and f.params["group"] == "layer")
    doc = _run(write_faulty_target(f, tmp_path / "t"), tmp_path / "run")
    miss = [x for x in doc.findings if x.kind == "mtp_weights_missing"]
    assert doc.verdict == "mismatch" and doc.error is None and len(miss) == 1
    assert doc.acceptance is None and any("no acceptance budget" in n for n in doc.notes)
    assert doc.sentence.startswith("The head's checkpoint: SGLang's DeepseekV3ForCausalLMNextN reads the head from "
                                   "model.layers.8.*")
