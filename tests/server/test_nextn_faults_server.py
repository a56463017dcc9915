"""Generated MTP / NextN faults on a live SGLang 0.5.23 NEXTN server at TP 1 (extended tier; two server starts for
the module): ``investigate`` names each fault in its stage of the NextN budget, and a clean server comes out ``ok``.

* The faulty server: the first seeded draw of a checkpoint fault (tests/support/mtp_faults.py) that costs a material
  loss offline, written into a copy of the target folder, served with the first drawn ``steps`` value (more steps than the head was trained for) and the
  ``pre_norm`` state fault (``helpers.hooks`` ``wrong_layer`` out(7) on the target's logits processor): the draft
  stage names the weights (``draft_underperforms``, on the log's own rows), the settings stage the steps
  (``mtp_steps_beyond_head``) and the state identification the pre-norm state (``norm_mismatch``).
* The clean server: the shipped target, 1 step: every stage clear, verdict ``ok`` (exit 0).
"""
from __future__ import annotations

import time
from itertools import count

import pytest

from helpers.hooks import DEEPSEEK, hook_specs
from helpers.server.embedded import start
from support.mtp_faults import TARGET, VALIDATION, draw, hook_faults, served_steps, write_faulty_target

pytestmark = pytest.mark.extended

PROMPTS, NEW = 12, 24


def _first(kinds: tuple[str, ...]):
    return draw(next(s for s in count() if draw(s).kind in kinds))


def _first_material(tmp):
    """The first seed whose draw is a checkpoint fault that costs a material loss offline (the draft stage on the
    log's rows counts it; a milder draw is cleared, rightly: bench/bench_mtp_faults.py), and its target copy."""
    from helpers.draft.loader import load_draft
    from helpers.draft.nextn_stage import nextn_draft_stage
    for seed in count():
        f = draw(seed)
        if not f.checkpoint:
            continue
        folder = write_faulty_target(f, tmp / f"target-{seed}")
        if nextn_draft_stage(load_draft(folder, folder), folder, 1, validation=VALIDATION)["loss"]["decision"] == \
                "counts":
            return f, folder


def _serve(folder, steps: int, faults=()):
    from helpers.server.settings import SpecSettings
    t0 = time.monotonic()
    hooks = hook_specs(list(faults), num_layers=8, family=DEEPSEEK) if faults else None
    h = start(folder, None, tp=1, spec=SpecSettings(algorithm="NEXTN", num_steps=steps, topk=1,
                                                      num_draft_tokens=steps + 1), forward_hooks=hooks, timeout=1200)
    print(f"\n[nextn faults] TP 1 NEXTN server ({folder}, steps {steps}, hooks {[f.kind for f in faults]}) ready in "
          f"{time.monotonic() - t0:.1f} s")
    return h


def _investigate(url, run_dir):
    from helpers.investigation.live import investigate
    t0 = time.monotonic()
    doc = investigate(url, training=None, run_dir=run_dir, measure_prompts=PROMPTS, max_new_tokens=NEW, timeout=900,
                      apply_fix=False, engine_probes="none", validation=VALIDATION)
    print(f"[nextn faults] investigate: {time.monotonic() - t0:.1f} s; verdict {doc.verdict}; {doc.sentence}")
    return doc


@pytest.fixture(scope="module")
def faulty(tmp_path_factory):
    if not (TARGET / "nextn_training_log.json").is_file() or not VALIDATION.is_dir():
        pytest.skip("the Kimi-class target's NextN head or its validation rows are not built here")
    weights, folder = _first_material(tmp_path_factory.mktemp("nextn-faulty"))
    steps, state = _first(("steps",)), _first(("pre_norm",))
    h = _serve(folder, served_steps(steps), hook_faults(state))
    try:
        yield h, (weights, steps, state), _investigate(h.url, tmp_path_factory.mktemp("run-faulty"))
    finally:
        h.stop()


def test_each_drawn_fault_is_named_in_its_stage(faulty):
    _, (weights, steps, state), doc = faulty
    kinds = [f.kind for f in doc.findings]
    b = doc.acceptance
    assert doc.verdict == "mismatch" and doc.error is None
    # the weights: the draft stage against the log, on the log's own rows
    d = b["losses"]["draft"]
    assert b["draft_stage"]["same_rows"] and d["decision"] == "counts", (weights.label(), d)
    assert "draft_underperforms" in kinds or b["cause"] == "draft"
    # the steps: the settings stage, with the per-step accuracy at the untrained steps
    sc = b["settings_check"]
    assert sc["served_steps"] == served_steps(steps) and sc["trained_steps"] == 1
    assert len(sc["untrained"]) == min(served_steps(steps), 3) - 1 and "mtp_steps_beyond_head" in kinds
    # the state: the served rows are out(7), the pre-norm state
    ident = doc.diagnosis["served_state"]
    assert ident["identified"] == f"out({state.params['layer']})" and "norm_mismatch" in kinds


@pytest.fixture(scope="module")
def clean(tmp_path_factory, faulty):          # after the faulty server: never two servers at once
    h = _serve(TARGET, 1)
    try:
        yield _investigate(h.url, tmp_path_factory.mktemp("run-clean"))
    finally:
        h.stop()


def test_clean_server_is_ok(clean):
    doc = clean
    b = doc.acceptance
    assert doc.findings == [] and doc.error is None
    for stage in ("draft", "wiring", "engine"):
        assert b["losses"][stage]["decision"] == "clear", (stage, b["losses"][stage])
    assert b["cause"] == "none" and doc.verdict == "ok"
