"""The acceptance budget on generated faults it was not shaped on, offline (no server): every class of
``support.faultgen`` (a damaged draft tensor, a permuted d2t, shifted draft config ids, a chunk order, other
speculative settings, a draft-side engine hook emulated, clean) at random strengths, through the budget with the
draft, wiring, engine and settings stages all required (``support.fault_offline``).

What must hold, for every draw: no counted cause other than the fault's true stage; no counted cause on a clean
draw; a fault whose true loss (the drafting chain of the clean server minus the faulty one on 64 greedy sequences,
paired) is at least 0.2 tokens per verify step is never put at ``none``. For settings draws the loss the budget
answers for is the accept length lost to settings that the clean chain dominates in the budget's cost model (accepts
more at a modelled throughput, accept length / (1 + steps x draft cost), at least theirs); settings modelled faster
than it trade accepted tokens for throughput, a note, not a loss (``OfflineMatrix.settings_loss``).

``E3F_FAULT_SEED`` picks other draws (default 0); bench/bench_faults.py --offline runs more of them."""
from __future__ import annotations

import os

import pytest

from support.fault_offline import MATERIAL_LIVE, OfflineMatrix, budget_loss, confusion, goal_checks, table_markdown
from support.faultgen import CLASSES, draws

SEED = int(os.environ.get("E3F_FAULT_SEED", "0"))
N = 2 * len(CLASSES)


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    return OfflineMatrix(tmp_path_factory.mktemp("fault-matrix"))


def test_generated_faults_are_put_at_their_stage_offline(matrix):
    rows = [matrix.run(f) for f in draws(N, SEED)]
    table = table_markdown(confusion(rows))
    g = goal_checks(rows)
    bad = g["wrong_cause"] + g["false_alarm"] + g["none_on_material_loss"]
    detail = "\n".join(f"{r['stage']:8} {r['label']:52} loss {r['loss']:.2f} [{r['loss_ci'][0]:.2f}, "
                       f"{r['loss_ci'][1]:.2f}] (budget's {budget_loss(r):.2f}) -> {r['cause']}: {r['sentence']}"
                       for r in bad)
    assert not bad, f"seed {SEED}\n{table}\n{detail}"
    # every class was drawn and faults clearly beyond the threshold were put at their stage: not vacuous
    assert {r["class"] for r in rows} == set(CLASSES)
    strong = [r for r in rows if r["stage"] != "none" and r["loss_ci"][0] >= 2 * MATERIAL_LIVE]
    assert strong and all(r["cause"] == r["stage"] for r in strong), table
    # the clean draws: the clean server against itself loses nothing, and every stage's CI says so
    for r in rows:
        if r["stage"] == "none":
            assert abs(r["loss"]) < 1e-9 and r["cause"] == "none", r["sentence"]
