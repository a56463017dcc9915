"""vLLM-specific GENERATED faults from public reports (issue 38, part 4; ``support.vllm_faultgen``), live on the
embedded vLLM 0.32.0 server with a speculators-format draft converted from the trained head_dim-64 draft: two server
starts in all, both extended (CI has no room):

* a clean conversion (ids written vLLM's way): ``investigate`` names no fault (no false finding);
* one draft with the four faults drawn from a seed, each with its drawn strength: ``norm_before_fc`` dropped by the
  conversion (the draft was trained with it; the weight kept or not, drawn), the rope scaling dropped (rope_theta
  forwarded), an own ``embed_tokens`` unlike the target's (vLLM keeps it), the layer ids lost (vLLM's default ids).
  Each is named at its stage with its own evidence: the ids by the served tensors against the training data (wiring,
  the fallback in the served plan's notes), the embedding and a kept ``input_norm.weight`` by the draft checks under
  vLLM's loader rules, and the dropped norm / rope by the checkpoint stage (the served checkpoint teacher-forced
  below the training log, where the draft as trained is not: measured offline here, with vLLM's loader rules).

The engine stage is not asserted: ``engine_probes="none"`` and the live measurement is greedy. The offline hit table
over 20 seeds: ``bench/bench_vllm_faults.py`` (bench/RESULTS.md)."""
from __future__ import annotations

from pathlib import Path

import pytest

from helpers.engines.vllm_server import vllm_python
from helpers.investigation.live import investigate
from support.vllm_faultgen import DRAFT, H64, TARGET, TRAINED_OUT, VALIDATION, VLLMFault, build_all, draw
from test_vllm_faults import registry, server  # noqa: F401  (the module's registry fixture, its server start)

pytestmark = [pytest.mark.server, pytest.mark.vllm, pytest.mark.extended]
if not vllm_python().exists():
    pytest.skip("env/vllm/.venv is missing (make setup without SKIP_VLLM=1)", allow_module_level=True)
SEED = 38
WIRING = {"wrong_layer", "layer_offset", "embedding_in_place_of_layer", "unidentified_chunk", "rotated_basis"}
KW = dict(apply_fix=False, num_samples=3, measure_prompts=8, max_new_tokens=24, sweeps=(), engine_probes="none",
          validation=VALIDATION)


def checkpoint_stage(folder: Path, training: Path) -> dict:
    """The draft stage offline: ``folder`` loaded with vLLM 0.32.0's loader rules, teacher-forced on the validation
    rows against the reference training log (``{"accept_length", "delta", "ci", "decision"}``)."""
    from helpers.draft.draft_stage import draft_rows, draft_stage
    from helpers.draft.model import Eagle3Draft
    from helpers.draft.training_log import read_training_log
    from helpers.engines.vllm import VLLMAdapter

    log = read_training_log(DRAFT / "training_log.json")
    d = Eagle3Draft.load(folder, TARGET, loader=VLLMAdapter().loader_rules("0.32.0"))
    dr = draft_rows(d, draft_dir=folder, target_dir=TARGET, training=training, hidden_size=128, log=log,
                    log_path=DRAFT / "training_log.json", validation=VALIDATION)
    st, loss = draft_stage(dr["rows"], dr["kind"], dr["path"], log, 3, labels=dr["labels"])
    return {"accept_length": st["accept_length"], **{k: loss[k] for k in ("delta", "ci", "decision")}}


def test_a_clean_speculators_conversion_is_no_finding(tmp_path):
    b = VLLMFault(SEED, "clean").build(tmp_path / "clean")
    with server(b.served) as url:
        doc = investigate(url, training=b.training, run_dir=tmp_path / "run", training_log=b.training_log, **KW)
    kinds = [f.kind for f in doc.findings]
    assert doc.verdict == "ok" and not kinds, (doc.verdict, kinds)
    losses = doc.acceptance["losses"]
    assert losses["draft"]["decision"] != "counts" and losses["wiring"]["decision"] != "counts", losses
    assert doc.acceptance["cause"] not in ("draft", "wiring"), doc.acceptance["sentence"]
    print(f"\n[vllm-gen-faults] clean: verdict {doc.verdict}, findings {kinds}, cause {doc.acceptance['cause']}, "
          f"losses {({k: (v['decision'], round(v['delta'], 2)) for k, v in losses.items() if v.get('delta') is not None})}")


def test_four_drawn_vllm_faults_on_one_draft_are_each_named_at_their_stage(tmp_path):
    faults = [draw(SEED + i, c) for i, c in enumerate(("norm_before_fc_dropped", "rope_scaling_dropped",
                                                        "own_embedding", "ids_lost"))]
    b = build_all(faults, tmp_path / "faulty")
    p = {f.cls: f.params for f in faults}
    # the truth, offline: the draft as trained is as good as the log; the served conversion of its norm / rope
    # (without the own embedding, whose own check names it) is not
    norm_rope = build_all(faults[:2], tmp_path / "norm-rope")
    trained, served = checkpoint_stage(norm_rope.trained, norm_rope.training), \
        checkpoint_stage(norm_rope.served, norm_rope.training)
    assert trained["decision"] != "counts", trained
    with server(b.served) as url:
        doc = investigate(url, training=b.training, run_dir=tmp_path / "run", training_log=b.training_log, **KW)
    kinds = [f.kind for f in doc.findings]
    # ids lost (wiring): the served tensors against the training data, the fallback to vLLM's default ids
    moved = {c for c, (a, t) in enumerate(zip(TRAINED_OUT, p["ids_lost"]["trained_out"])) if a != t}
    wiring = [f for f in doc.findings if f.kind in WIRING]
    if "layer_offset" in kinds:                       # every chunk shifted by one offset: one finding for all
        assert moved == {0, 1, 2}, (kinds, moved)
    else:
        assert {f.chunk for f in wiring} == moved, (kinds, [f.chunk for f in wiring], moved)
    assert any("falls back" in n and "get_eagle3_default_aux_hidden_state_layers" in n
               for n in doc.diagnosis["served_plan"]["notes"])
    # the own embedding (draft): vLLM keeps it
    emb = next(f for f in doc.findings if f.kind == "embedding_not_shared")
    assert emb.evidence["rel_diff"] > 0.5 * p["own_embedding"]["strength"], emb.evidence
    # the dropped norm (draft): a kept input_norm.weight is named as dropped by vLLM's loader
    ignored = [f for f in doc.findings if f.kind == "draft_weight_ignored"]
    assert bool(ignored) == p["norm_before_fc_dropped"]["keep_weight"], kinds
    if ignored:
        assert ignored[0].evidence["tensors"] == ["input_norm.weight"] and "norm_before_fc" in ignored[0].detail
    # the dropped norm / rope (draft): the checkpoint stage falls below the log when the offline truth says so
    losses = doc.acceptance["losses"]
    if served["decision"] == "counts":
        assert losses["draft"]["decision"] == "counts" and losses["draft"]["ci"][0] > 0, losses["draft"]
        assert "draft_underperforms" in kinds and doc.acceptance["cause"] == "draft", (kinds, doc.acceptance["cause"])
    # the wiring stage's acceptance loss is not asserted: the draft's weights are the reference's (trained on the
    # default's plan), so the fallback costs no acceptance here; the finding is the served tensors' evidence
    print(f"\n[vllm-gen-faults] {[f.label for f in faults]}: verdict {doc.verdict}, findings {kinds}, cause "
          f"{doc.acceptance['cause']}, losses {({k: (v['decision'], round(v['delta'], 2)) for k, v in losses.items() if v.get('delta') is not None})}; "
          f"offline norm+rope: as trained {trained['accept_length']:.2f} ({trained['decision']}), served "
          f"{served['accept_length']:.2f} ({served['decision']} {served['delta']:+.2f})")
