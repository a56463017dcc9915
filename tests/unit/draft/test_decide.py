"""helpers.draft.decide: a loss counts only beyond its CI and material, is clear only when its CI rules a material
loss out, and is otherwise undecided with a sample count that settles it -- checked by drawing that many samples."""
from __future__ import annotations

import numpy as np
import pytest

from helpers.draft.decide import decide, threshold


def _ci(x: np.ndarray, seed: int = 0) -> tuple[float, float, float]:
    rng = np.random.default_rng(seed)
    means = x[rng.integers(0, len(x), size=(2000, len(x)))].mean(1)
    lo, hi = np.percentile(means, [2.5, 97.5])
    return float(x.mean()), float(lo), float(hi)


def test_three_outcomes():
    thr = threshold(2.5)
    assert thr == pytest.approx(0.2)
    assert threshold(None) == 0.1 and threshold(0.5) == 0.1
    assert decide(0.5, 0.3, 0.7, thr)["decision"] == "counts"
    assert decide(0.02, -0.05, 0.1, thr)["decision"] == "clear"
    u = decide(0.25, -0.2, 0.7, thr, n=3)
    assert u["decision"] == "undecided" and u["settle"]["n"] > 3 and "sequences" in u["settle"]["text"]
    assert decide(None, None, None, thr)["decision"] == "undecided"
    assert decide(0.15, 0.05, 0.25, thr, n=10)["decision"] == "undecided"     # real but maybe immaterial
    assert decide(float("nan"), 0, 1, thr)["decision"] == "undecided"


@pytest.mark.parametrize("mean", [0.45, 0.02])
def test_the_settle_count_decides(mean):
    """Per-sequence losses drawn around a mean: undecided on 4 sequences; on the count the decision names, the same
    population decides (counts for a material loss, clear for none)."""
    rng = np.random.default_rng(1)
    pop = lambda n: rng.normal(mean, 1.0, size=n)                   # noqa: E731
    thr = threshold(2.5)
    d = decide(*_ci(pop(4)), thr, n=4)
    assert d["decision"] == "undecided", d
    n = d["settle"]["n"]
    assert n is not None and n > 4
    big = decide(*_ci(pop(int(n * 1.5)), seed=2), thr, n=int(n * 1.5))
    assert big["decision"] == ("counts" if mean > thr else "clear"), (n, big)
