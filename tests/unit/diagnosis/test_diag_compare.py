"""helpers.diagnosis.compare: metric values against direct float64 formulas, block-size invariance, token alignment,
tolerances, and bounded memory while streaming."""
from __future__ import annotations

import weakref
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers.diagnosis.compare import compare, tolerance_for
from helpers.formats.dumps import Sample, SampleSource
from helpers.errors import BadInput


def sample(key, ids, rows, **kw):
    return Sample(key=key, rows=rows.shape[0], width=rows.shape[1], loader=lambda r=rows: r,
                  input_ids=np.asarray(ids, np.int64), **kw)


def source(samples, **kw):
    return SampleSource(path=Path("served"), kind="served", format="e3f-dump", samples=samples, **kw)


def direct(x: torch.Tensor, y: torch.Tensor) -> dict:
    x, y = x.double(), y.double()
    rel = 1 - 2 * (x * y).sum() / ((x * x).sum() + (y * y).sum())          # DeepGEMM / SGLang calc_rel_diff
    cos = (x * y).sum() / (x.norm() * y.norm())
    d = (x - y).abs()
    flat = int(d.argmax())
    return {"rel": float(rel), "cos": float(cos), "ratio": float(x.norm() / y.norm()), "max": float(d.max()),
            "at": divmod(flat, x.shape[1])}


@pytest.fixture
def data():
    g = torch.Generator().manual_seed(0)
    H, L = 16, 12
    tr = [torch.randn(L, 3 * H, generator=g) for _ in range(2)]
    ids = [list(range(10, 10 + L)), list(range(40, 40 + L))]
    # served = training with chunk 1 perturbed, chunk 2 = training chunk 0 scaled, 9 rows (prompt 7 + 2 decode)
    sv = []
    for t in tr:
        s = t[:9].clone()
        s[:, H:2 * H] += 0.01 * torch.randn(9, H, generator=g)
        s[:, 2 * H:] = 1.5 * t[:9, :H]
        sv.append(s)
    return H, tr, ids, sv


def test_metrics_equal_direct_formulas(data):
    H, tr, ids, sv = data
    served = source([sample(f"s{k}", ids[k][:9], sv[k], num_prompt_tokens=7, output_ids=ids[k][7:10])
                     for k in range(2)])
    train = [sample(f"data_{k}", ids[k], tr[k], sample_id=f"data_{k}") for k in range(2)]
    c = compare(iter(train), [served], hidden_size=H, training_width=3 * H, tolerance=1e-6)
    src = c.primary
    X = torch.cat(sv)
    Y = torch.cat([t[:9] for t in tr])
    for i in range(3):
        for j in range(3):
            m = c.metrics(src, i, j)
            ref = direct(X[:, i * H:(i + 1) * H], Y[:, j * H:(j + 1) * H])
            assert m.rel_diff == pytest.approx(ref["rel"], rel=1e-6, abs=1e-12)
            assert m.cosine == pytest.approx(ref["cos"], rel=1e-6, abs=1e-9)
            assert m.norm_ratio == pytest.approx(ref["ratio"], rel=1e-6)
            # per-row statistics: rows within the tolerance counted exactly, quantiles to one bin (x1.26)
            x, y = X[:, i * H:(i + 1) * H].double(), Y[:, j * H:(j + 1) * H].double()
            per_row = ((x - y) ** 2).sum(1) / ((x * x).sum(1) + (y * y).sum(1))
            assert m.share_within == pytest.approx(float((per_row <= 1e-6).double().mean()))
            med = float(per_row.median())
            assert m.row_rel_diff["p50"] / 10 ** 0.1 * (1 - 1e-9) <= max(med, 1e-12) <= m.row_rel_diff["p50"] * (1 + 1e-9)
            assert m.passed == (m.share_within >= 0.9)
            if ref["rel"] <= 1e-2:      # near pairs: max |x - y| with its coordinate
                assert m.max_abs_diff == pytest.approx(ref["max"], rel=1e-6)
                r, col = ref["at"]
                at = m.max_abs_at
                assert (at["sample"], at["row"], at["column"]) == (f"s{r // 9}", r % 9, col)
                assert at["position"] == r % 9 and at["token_id"] == ids[r // 9][r % 9]
            else:                       # far pairs skip the elementwise pass
                assert m.max_abs_diff is None and m.max_abs_at is None
            assert m.min_tolerance == {"row_rel_diff_p90": m.row_rel_diff["p90"], "rel_diff": m.rel_diff,
                                       "max_abs": m.max_abs_diff}
            assert m.rows == 18
    # chunk 0 identical, chunk 2 = 1.5 x training chunk 0: cosine 1, norm ratio 1.5
    assert c.metrics(src, 0, 0).rel_diff == 0.0 and c.metrics(src, 0, 0).passed
    m = c.metrics(src, 2, 0)
    assert m.min_row_cosine == pytest.approx(1.0, abs=1e-6) and m.norm_ratio == pytest.approx(1.5, rel=1e-6)
    assert m.row_norm_ratio_min == pytest.approx(1.5, rel=1e-5) and m.row_norm_ratio_max == pytest.approx(1.5, rel=1e-5)
    assert c.alignment.paired_by == {"input_ids": 2} and c.alignment.rows_compared == 18
    assert c.alignment.decode_rows_compared == 4


def test_block_size_does_not_change_results(data):
    H, tr, ids, sv = data
    res = []
    for block in (2, 5, 256):
        served = source([sample(f"s{k}", ids[k][:9], sv[k]) for k in range(2)])
        train = [sample(f"data_{k}", ids[k], tr[k]) for k in range(2)]
        c = compare(train, [served], hidden_size=H, training_width=3 * H, block_rows=block)
        res.append([(c.metrics(c.primary, i, j).rel_diff, c.metrics(c.primary, i, j).max_abs_diff,
                     str(c.metrics(c.primary, i, j).max_abs_at)) for i in range(3) for j in range(3)])
    for other in res[1:]:
        for a, b in zip(res[0], other):
            assert a[0] == pytest.approx(b[0], rel=1e-9, abs=1e-15)
            assert (a[1], a[2]) == (b[1], b[2])


def test_alignment_stops_at_divergence_and_reports_prompt_mismatch(data):
    H, tr, ids, sv = data
    bad_decode = list(ids[0][:8]) + [999]                 # last decode row's input token differs
    bad_prompt = list(ids[1][:3]) + [777] + list(ids[1][4:9])
    served = source([sample("a", bad_decode, sv[0], num_prompt_tokens=7),
                     sample("b", bad_prompt, sv[1], num_prompt_tokens=7, sample_id="data_1")])
    train = [sample(f"data_{k}", ids[k], tr[k], sample_id=f"data_{k}") for k in range(2)]
    c = compare(train, [served], hidden_size=H, training_width=3 * H)
    a = c.alignment
    assert a.rows_compared == 8 + 3 and a.decode_rows_compared == 1
    (mm,) = a.token_mismatches
    assert (mm["served_sample"], mm["position"], mm["served_token_id"], mm["rows_compared"]) == ("b", 3, 777, 3)


def test_bad_inputs(data):
    H, tr, ids, sv = data
    train = [sample("data_0", ids[0], tr[0])]
    with pytest.raises(BadInput, match="not a multiple of the target hidden size"):
        compare(train, [source([sample("a", ids[0][:9], sv[0][:, :40])])], hidden_size=H, training_width=3 * H)
    with pytest.raises(BadInput, match="mismatched token ids"):
        compare(train, [source([sample("a", [1] * 9, sv[0])])], hidden_size=H, training_width=3 * H)


def test_tolerance_from_dtype():
    assert tolerance_for("bfloat16", "float32") == 2e-3
    assert tolerance_for("float32", None) == 1e-5
    assert tolerance_for("float16") == 1e-3
    assert tolerance_for(None, "weird") == 1e-5


def test_streaming_keeps_a_bounded_number_of_samples_alive():
    """Training samples are loaded one at a time and released: at most 2 loaded training tensors are alive
    at any point, whatever the number of samples (also when a block the calling thread stole stays queued for a slow
    worker: its work item holds the block, not the tensors)."""
    H, L, N = 8, 10, 40
    alive = {"now": 0, "max": 0}

    def loader(k):
        def load():
            t = torch.randn(L, 3 * H, generator=torch.Generator().manual_seed(k))
            alive["now"] += 1
            alive["max"] = max(alive["max"], alive["now"])
            weakref.finalize(t, lambda: alive.__setitem__("now", alive["now"] - 1))
            return t
        return load

    def stream():
        for k in range(N):
            yield Sample(key=f"data_{k}", rows=L, width=3 * H, loader=loader(k),
                         input_ids=np.arange(k * 100, k * 100 + L), sample_id=f"data_{k}")

    served = source([sample(f"s{k}", np.arange(k * 100, k * 100 + L),
                            torch.randn(L, 3 * H, generator=torch.Generator().manual_seed(k)), sample_id=f"data_{k}")
                     for k in range(0, N, 4)])
    c = compare(stream(), [served], hidden_size=H, training_width=3 * H)
    assert c.alignment.samples_paired == N // 4 and c.alignment.training_samples_seen == N
    assert alive["max"] <= 2


def test_a_non_finite_chunk_leaves_the_other_chunks_rows_in_their_pairs(data):
    """Each chunk pair takes the rows finite in both of its chunks: chunk 0 NaN on every row of sample 0 and chunk 1
    Inf on two rows of sample 1 change nothing for chunk 2's pairs, and chunk 0's pairs keep sample 1's rows."""
    H, tr, ids, sv = data
    train = [sample(f"data_{k}", ids[k], tr[k], sample_id=f"data_{k}") for k in range(2)]
    bad = [sv[0].clone(), sv[1].clone()]
    bad[0][:, :H] = float("nan")
    bad[1][[2, 5], H:2 * H] = float("inf")
    ref = compare(train, [source([sample(f"s{k}", ids[k][:9], sv[k], sample_id=f"data_{k}") for k in range(2)])],
                  hidden_size=H, training_width=3 * H)
    c = compare(train, [source([sample(f"s{k}", ids[k][:9], bad[k], sample_id=f"data_{k}") for k in range(2)])],
                hidden_size=H, training_width=3 * H)
    src = c.primary
    assert src.pairs.n[0].tolist() == [9, 9, 9] and src.pairs.n[1].tolist() == [16, 16, 16]
    assert src.pairs.n[2].tolist() == [18, 18, 18]
    for j in range(3):
        a, b = c.metrics(src, 2, j), ref.metrics(ref.primary, 2, j)
        assert (a.rows, a.share_within) == (b.rows, b.share_within)
        assert a.rel_diff == pytest.approx(b.rel_diff, rel=1e-9)
    assert c.metrics(src, 2, 0).max_abs_diff == pytest.approx(ref.metrics(ref.primary, 2, 0).max_abs_diff)
    m00 = c.metrics(src, 0, 0)
    assert m00.rows == 9 and m00.passed                                 # sample 1's chunk-0 rows still compared
    assert src.stats.nonfinite == [9, 2, 0]


def test_rows_of_a_sample_whose_prompt_differs_are_compared_apart(data):
    """Rows before a prompt mismatch may belong to another sample: they go to the suspect accumulator only."""
    H, tr, ids, sv = data
    bad_prompt = list(ids[1][:3]) + [777] + list(ids[1][4:9])
    served = source([sample("a", ids[0][:9], sv[0], num_prompt_tokens=7),
                     sample("b", bad_prompt, sv[1], num_prompt_tokens=7, sample_id="data_1")])
    train = [sample(f"data_{k}", ids[k], tr[k], sample_id=f"data_{k}") for k in range(2)]
    c = compare(train, [served], hidden_size=H, training_width=3 * H)
    assert c.alignment.rows_compared == 12 and c.alignment.rows_in_mismatched_samples == 3
    assert (c.primary.pairs.n == 9).all() and (c.primary.suspect.n == 3).all()
    assert c.reservoir.count == 9
