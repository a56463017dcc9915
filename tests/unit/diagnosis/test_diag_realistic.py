"""The diagnosis on data shaped like a real 30-80 layer target (``tests/support/realistic.py``: massive activations on
the first token and delimiters, adjacent layers at row cosine 0.90-0.99, outlier dims, bf16 engine noise growing
with depth): clean data at several depths and noise levels give no finding; every finding kind injected into
one chunk and into all chunks is named, and nothing else is.

The generator is this project's own and is not tuned to a case: its knobs are the published statistics, and
the faults are drawn on top of it exactly as a deployment would produce them (config edits read through
SGLang's rules, hook-injected tensors, per-rank captures).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from support.forensic_cases import partial_rows, sharded_rows, unreduced_embedding_rows
from helpers.diagnosis.compare import MATCH_SHARE
from helpers.diagnosis.diagnose import diagnose
from support.realistic import World, outs, specforge_default

H = 256


def kinds(d) -> list[tuple]:
    return sorted((f["kind"], -1 if f["chunk"] is None else f["chunk"]) for f in d.findings)


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    """Synthetic targets: 32 and 61 layers, 256 wide, bf16 engines at 1 % relative noise."""
    root = tmp_path_factory.mktemp("realistic")
    return {n: World.make(root / f"d{n}", layers=n, hidden=H, noise=1e-2, seed=n) for n in (32, 61)}


def _orth(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    q, r = torch.linalg.qr(torch.randn(H, H, generator=g, dtype=torch.float64))
    return (q * torch.sign(torch.diagonal(r))).float()


def _chunk_map(fn, chunks):
    """mutate(i, rows) applying ``fn`` to the listed chunks of a [T, 3H] block."""
    def mutate(_, rows):
        r = rows.float().clone()
        for c in chunks:
            r[:, c * H:(c + 1) * H] = fn(r[:, c * H:(c + 1) * H])
        return r.to(rows.dtype)
    return mutate


# ----------------------------------------------------------------------------------------------------- clean

@pytest.mark.parametrize("layers,noise,dtype", [(16, 0.0, torch.float32), (16, 3e-3, torch.bfloat16),
                                                (32, 1e-2, torch.bfloat16), (32, 3e-2, torch.bfloat16),
                                                (61, 1e-2, torch.bfloat16), (61, 3e-2, torch.bfloat16)])
def test_clean_data_give_zero_findings(tmp_path, layers, noise, dtype):
    w = World.make(tmp_path, layers=layers, hidden=H, noise=noise, dtype=dtype, seed=layers)
    ids = specforge_default(layers)
    train = w.training(outs(ids), manifest_ids=ids)
    dd, td = w.configs(ids)
    d = diagnose(train, [w.served_json(outs(ids))], draft_config=dd, target_config=td)
    assert d.findings == [], d.render_text()
    assert [c["matched_training_chunk"] for c in d.chunks] == [0, 1, 2]
    assert all(c["share_within"] >= MATCH_SHARE for c in d.chunks)
    assert d.training_plan.provenance == "manifest"
    # the massive rows dwarf the others and are reported as outliers: the first token or a delimiter, with the
    # massive dims carrying most of their energy
    ev = d.comparison.training_stats.outliers(1)
    top = ev["top_rows"][0]
    assert top["energy_vs_median_row"] > 100 and top["dims_energy_share"] > 0.9
    assert top["position"] == 0 or top["token_id"] in w.target.config.delimiters
    assert set(top["dims"][:2]) == set(w.target.massive_idx.tolist())
    if noise:
        assert 0 < d.noise["row_rel_diff_p90"] < d.comparison.tolerance


@pytest.mark.parametrize("tp", [2, 8])
def test_clean_per_rank_dumps(worlds, tp):
    w = worlds[32]
    ids = specforge_default(32)
    train = w.training(outs(ids), manifest_ids=ids)
    dd, td = w.configs(ids)
    d = diagnose(train, w.rank_dumps(outs(ids), tp), draft_config=dd, target_config=td)
    assert d.findings == [], d.render_text()


# ------------------------------------------------------------------------------------------ layer offsets

@pytest.mark.parametrize("n", [32, 61])
def test_one_chunk_one_layer_late_is_not_ok(worlds, n):
    """The middle chunk one layer late (hook-injected): the massive rows make it pass a global rel_diff; per row it
    does not. Without a reference it is a wrong layer whose identity the plans cannot give; with the server's
    every-layer reference it is named out(L+1)."""
    w = worlds[n]
    ids = specforge_default(n)
    train = w.training(outs(ids), manifest_ids=ids)
    dd, td = w.configs(ids)
    served = w.served_json(outs([ids[0], ids[1] + 1, ids[2]]))
    d = diagnose(train, [served], draft_config=dd, target_config=td)
    assert kinds(d) == [("wrong_layer", 1)], d.render_text()
    m = d.findings[0]["evidence"]["metrics"]
    assert m["share_within_tolerance"] < 0.5 and m["row_cosine_p50"] > 0.9     # close, yet not equal
    f = d.findings[0]
    assert "both call it" in f["detail"] and f"out({ids[1]})" in f["detail"]    # plans vs data, not a fact
    assert f["evidence"]["closest_training_chunks"][0]["training_chunk"] == 1
    d2 = diagnose(train, [served], draft_config=dd, target_config=td, reference=w.reference())
    assert kinds(d2) == [("wrong_layer", 1)], d2.render_text()
    ev = d2.findings[0]["evidence"]
    assert (ev["served_identified_as"], ev["training_identified_as"], ev["offset"]) == (
        f"out({ids[1] + 1})", f"out({ids[1]})", 1)
    assert ev["served_identified_by"] == "reference"


@pytest.mark.parametrize("n", [32, 61])
def test_all_chunks_one_layer_late_from_an_edited_config(worlds, n):
    """The draft config was edited to ids + 1 after training: with the training manifest the offset is named from
    the plans (and the data agree); without it the config claims both sides and only the data disagree (wrong
    layers, the note says what is missing); with the every-layer reference it is named from the data alone."""
    w = worlds[n]
    ids = specforge_default(n)
    edited = [i + 1 for i in ids]
    served = w.served_json(outs(edited))
    dd, td = w.configs(edited)
    with_manifest = w.training(outs(ids), manifest_ids=ids)
    d = diagnose(with_manifest, [served], draft_config=dd, target_config=td)
    assert kinds(d) == [("config_ids_mismatch", -1), ("layer_offset", 0), ("layer_offset", 1), ("layer_offset", 2)], \
        d.render_text()
    assert all(f["evidence"]["offset"] == 1 for f in d.findings if f["kind"] == "layer_offset")
    no_manifest = w.training(outs(ids))
    d2 = diagnose(no_manifest, [served], draft_config=dd, target_config=td)
    assert kinds(d2) == [("wrong_layer", 0), ("wrong_layer", 1), ("wrong_layer", 2)], d2.render_text()
    assert all("only what the draft config claims" in f["detail"] for f in d2.findings)
    d3 = diagnose(no_manifest, [served], draft_config=dd, target_config=td, reference=w.reference())
    assert kinds(d3) == [("layer_offset", 0), ("layer_offset", 1), ("layer_offset", 2)], d3.render_text()
    assert d3.training_plan.provenance == "inferred" and d3.training_plan.tensors == outs(ids)


@pytest.mark.parametrize("n", [32, 61])
def test_far_layer_in_one_chunk(worlds, n):
    w = worlds[n]
    ids = specforge_default(n)
    train = w.training(outs(ids), manifest_ids=ids)
    dd, td = w.configs(ids)
    d = diagnose(train, [w.served_json(outs([ids[0], ids[1], ids[2] - 9]))], draft_config=dd, target_config=td,
                 reference=w.reference())
    assert kinds(d) == [("wrong_layer", 2)], d.render_text()
    assert d.findings[0]["evidence"]["served_identified_as"] == f"out({ids[2] - 9})"


@pytest.mark.parametrize("n", [32, 61])
def test_a_chunk_that_is_no_layer_is_not_named_a_wrong_layer(worlds, n):
    """A mix of two adjacent layers (cosine 0.9-0.99 to each) matches no layer of the reference on any row: the
    finding says so instead of naming the closest layer."""
    w = worlds[n]
    ids = specforge_default(n)
    train = w.training(outs(ids), manifest_ids=ids)
    dd, td = w.configs(ids)
    base = w.served_json(outs(ids))
    other = w.served_json(outs([ids[0], ids[1] + 1, ids[2]]))
    mixed = json.loads(Path(base).read_text())
    for a, b in zip(mixed, json.loads(Path(other).read_text())):
        hs_a, hs_b = a["meta_info"]["hidden_states"], b["meta_info"]["hidden_states"]
        for i, (ra, rb) in enumerate(zip(hs_a, hs_b)):
            rows_a, rows_b = (ra, rb) if isinstance(ra[0], list) else ([ra], [rb])
            for x, y in zip(rows_a, rows_b):
                x[H:2 * H] = [0.5 * (u + v) for u, v in zip(x[H:2 * H], y[H:2 * H])]
    Path(base).write_text(json.dumps(mixed))
    d = diagnose(train, [base], draft_config=dd, target_config=td, reference=w.reference())
    assert kinds(d) == [("unidentified_chunk", 1)], d.render_text()
    assert "matches no layer of the target" in d.findings[0]["detail"]


# ------------------------------------------------------------------------------------ embedding and order

@pytest.mark.parametrize("chunk", [0, 1])
def test_embedding_in_place_of_a_layer(worlds, chunk):
    w = worlds[61]
    ids = specforge_default(61)
    train = w.training(outs(ids), manifest_ids=ids)
    dd, td = w.configs(ids)
    served = outs(ids)
    served[chunk] = "embedding"
    d = diagnose(train, [w.served_json(served)], draft_config=dd, target_config=td)
    assert kinds(d) == [("embedding_in_place_of_layer", chunk)], d.render_text()


@pytest.mark.parametrize("order", [[1, 0, 2], [2, 0, 1]])
def test_chunk_order(worlds, order):
    w = worlds[32]
    ids = specforge_default(32)
    train = w.training(outs(ids), manifest_ids=ids)
    dd, td = w.configs(ids)
    d = diagnose(train, [w.served_json(outs([ids[k] for k in order]))], draft_config=dd, target_config=td)
    assert kinds(d) == [("chunk_order", -1)], d.render_text()
    assert d.findings[0]["evidence"]["mapping"] == {str(i): j for i, j in enumerate(order) if i != j}


# --------------------------------------------------------------------------------------- fitted transforms

@pytest.mark.parametrize("n,chunks", [(32, [1]), (61, [2]), (32, [0, 1, 2])])
def test_rotated_basis_only_where_an_orthogonal_map_fits(worlds, n, chunks):
    w = worlds[n]
    ids = specforge_default(n)
    train = w.training(outs(ids), manifest_ids=ids)
    dd, td = w.configs(ids)
    q = _orth(7)
    d = diagnose(train, [w.served_json(outs(ids), mutate=_chunk_map(lambda x: x @ q, chunks))],
                 draft_config=dd, target_config=td)
    assert kinds(d) == [("rotated_basis", c) for c in chunks], d.render_text()
    fit = d.findings[0]["evidence"]["fit"]
    assert fit["fits"] and fit["stats"]["row_cosine_p50"] < 0.5
    assert fit["stats"]["norm_dev_p90"] <= fit["floor"]["norm"]


@pytest.mark.parametrize("n,chunks", [(32, [2]), (61, [0]), (61, [0, 1, 2])])
def test_norm_mismatch_only_where_an_rms_norm_fits(worlds, n, chunks):
    w = worlds[n]
    ids = specforge_default(n)
    train = w.training(outs(ids), manifest_ids=ids)
    dd, td = w.configs(ids)
    wt = w.target.norm_weight
    d = diagnose(train, [w.served_json(outs(ids), mutate=_chunk_map(
        lambda x: x / x.square().mean(-1, keepdim=True).sqrt() * wt, chunks))], draft_config=dd, target_config=td)
    assert kinds(d) == [("norm_mismatch", c) for c in chunks], d.render_text()
    assert d.findings[0]["evidence"]["fit"]["transform"] == "rms_norm"


def test_adjacent_layers_are_never_named_a_rotation_or_a_norm_even_without_norm_growth(tmp_path):
    """A target whose row norms do not grow from layer to layer (the hardest case for an isometry test): every
    chunk one layer late stays a layer offset / wrong layer."""
    w = World.make(tmp_path, layers=40, hidden=H, noise=1e-2, seed=5, norm_growth=1.0, cos_adjacent=(0.97, 0.995))
    ids = specforge_default(40)
    dd, td = w.configs(ids)
    served = w.served_json(outs([i + 1 for i in ids]))
    d = diagnose(w.training(outs(ids)), [served], draft_config=dd, target_config=td)
    assert {f["kind"] for f in d.findings} == {"wrong_layer"}, d.render_text()


# ------------------------------------------------------------------------------------------------ TP faults

def test_partial_sums_on_one_chunk(worlds):
    w = worlds[32]
    ids = specforge_default(32)
    t = outs(ids)
    train = w.training(t, manifest_ids=ids)
    dd, td = w.configs(ids)
    part = partial_rows(w.served, t, 2)

    def rank_rows(r, sp, st):
        full = torch.cat([st[x] for x in t], -1)
        full[:, H:2 * H] = part(r, sp, st)[:, H:2 * H]
        return full
    d = diagnose(train, w.rank_dumps(t, 2, rank_rows=rank_rows), draft_config=dd, target_config=td)
    assert kinds(d) == [("tp_partial_sum", 1)], d.render_text()


def test_sharded_width(worlds):
    w = worlds[32]
    ids = specforge_default(32)
    t = outs(ids)
    d = diagnose(w.training(t, manifest_ids=ids), w.rank_dumps(t, 2, rank_rows=sharded_rows(w.served, t, 2)))
    assert kinds(d) == [("tp_sharded_width", -1)], d.render_text()


def test_embedding_not_all_reduced(worlds):
    w = worlds[32]
    ids = specforge_default(32)
    served = ["embedding"] + outs(ids[1:])
    train = w.training(outs(ids), manifest_ids=ids)
    d = diagnose(train, w.rank_dumps(served, 2, rank_rows=unreduced_embedding_rows(w.served, served, 2)))
    assert ("embedding_not_all_reduced", 0) in kinds(d), d.render_text()
    assert not {k for k, _ in kinds(d)} - {"embedding_not_all_reduced", "embedding_in_place_of_layer"}


# ------------------------------------------------------------------------------------- width and NaN rows

def test_missing_and_extra_chunks(worlds):
    w = worlds[32]
    ids = specforge_default(32)
    train = w.training(outs(ids), manifest_ids=ids)
    d = diagnose(train, [w.served_json(outs(ids[:2]))])
    assert kinds(d) == [("missing_chunk", -1), ("width_mismatch", -1)], d.render_text()
    d2 = diagnose(train, [w.served_json(outs(ids) + ["out(20)"])])
    assert kinds(d2) == [("extra_chunk", 3), ("width_mismatch", -1)], d2.render_text()


def test_nan_rows_in_one_chunk(worlds):
    w = worlds[32]
    ids = specforge_default(32)
    train = w.training(outs(ids), manifest_ids=ids)

    def nan(_, rows):
        r = rows.clone()
        r[::5, H:2 * H] = float("nan")
        return r
    d = diagnose(train, [w.served_json(outs(ids), mutate=nan)])
    assert kinds(d) == [("nan_or_inf", 1)], d.render_text()


# ------------------------------------------------------------------- dead, scaled and partly altered chunks

def _case(w, n):
    ids = specforge_default(n)
    train = w.training(outs(ids), manifest_ids=ids)
    dd, td = w.configs(ids)
    return ids, train, dd, td


@pytest.mark.parametrize("use_ref", [False, True])
def test_an_all_nan_chunk_leaves_the_other_chunks_compared(worlds, use_ref):
    """Every row of chunk 0 NaN: that chunk is named nan_or_inf and left unsettled (a note, no layer finding);
    chunks 1 and 2 are compared on all their rows and match."""
    w = worlds[32]
    ids, train, dd, td = _case(w, 32)
    served = w.served_json(outs(ids), mutate=_chunk_map(lambda x: torch.full_like(x, float("nan")), [0]))
    d = diagnose(train, [served], draft_config=dd, target_config=td, reference=w.reference() if use_ref else None)
    assert kinds(d) == [("nan_or_inf", 0)], d.render_text()
    f = d.findings[0]
    rows = f["evidence"]["rows_total"]
    assert f["evidence"]["rows"] == rows and f["evidence"]["finite_rows"] == 0 and "not settled" in f["detail"]
    assert [c["matched_training_chunk"] for c in d.chunks] == [None, 1, 2]
    assert d.chunks[0]["share_within"] is None                       # nothing measured, not "0 %"
    for i in (1, 2):
        m = d.comparison.metrics(d.comparison.primary, i, i)
        assert m.rows == rows and m.share_within >= MATCH_SHARE    # the NaN chunk took no row away
    assert any(n.startswith("chunk 0: inconclusive, no comparable rows") for n in d.notes), d.notes


@pytest.mark.parametrize("use_ref", [False, True])
def test_an_all_zero_chunk_is_a_zero_chunk_not_a_layer(worlds, use_ref):
    w = worlds[32]
    ids, train, dd, td = _case(w, 32)
    served = w.served_json(outs(ids), mutate=_chunk_map(torch.zeros_like, [1]))
    d = diagnose(train, [served], draft_config=dd, target_config=td, reference=w.reference() if use_ref else None)
    assert kinds(d) == [("zero_chunk", 1)], d.render_text()
    ev = d.findings[0]["evidence"]
    assert ev["zero_rows"] == ev["finite_rows"] == ev["rows"] > 100 and ev["training_zero_rows"] == 0
    assert "nan" not in d.findings[0]["detail"]


@pytest.mark.parametrize("n,chunks,factor", [(32, [1], 2.0), (61, [0, 1, 2], 0.5)])
def test_a_scaled_copy_of_the_right_layer_is_named_scaled(worlds, n, chunks, factor):
    """The right tensor times a constant: rows point the same way with a constant norm ratio. Named scaled_chunk
    with the measured factor and its spread, with or without the every-layer reference (no layer equals it)."""
    w = worlds[n]
    ids, train, dd, td = _case(w, n)
    served = w.served_json(outs(ids), mutate=_chunk_map(lambda x: factor * x, chunks))
    for ref in (None, w.reference()):
        d = diagnose(train, [served], draft_config=dd, target_config=td, reference=ref)
        assert kinds(d) == [("scaled_chunk", c) for c in chunks], d.render_text()
        for f, c in zip(d.findings, chunks):
            ev = f["evidence"]
            assert ev["training_chunk"] == c
            assert abs(ev["factor"] / factor - 1) < 0.01 and abs(ev["norm_ratio_geomean"] / factor - 1) < 0.01
            st = ev["fit"]["stats"]
            assert st["share_within"] >= MATCH_SHARE and st["share_within_unscaled"] == 0
            assert 0.98 * factor < st["row_factor_p10"] <= st["row_factor_p90"] < 1.02 * factor
            assert ev["log_norm_ratio_std"] < 0.01
            assert "one of them is wrong" not in f["detail"] and "not another layer" in f["detail"]


def test_a_massive_dim_zeroed_on_the_massive_rows_is_a_partial_match(worlds):
    """One massive-activation dim zeroed on the massive rows only (first token, delimiters): the ordinary rows
    equal the training chunk, so this is the right tensor with a minority of rows altered, not a wrong layer and
    not a contradiction of the plans. The evidence names the rows (high energy) and the dim."""
    w = worlds[32]
    ids, train, dd, td = _case(w, 32)
    dim = int(w.target.massive_idx[0])

    def zero_massive(_, rows):
        r = rows.float().clone()
        c = r[:, 2 * H:3 * H]
        big = c.abs().amax(1) > 50 * c.abs().median()
        c[big, dim] = 0
        return r.to(rows.dtype)
    served = w.served_json(outs(ids), mutate=zero_massive)
    for ref in (None, w.reference()):
        d = diagnose(train, [served], draft_config=dd, target_config=td, reference=ref)
        assert kinds(d) == [("partial_match", 2)], d.render_text()
        f = d.findings[0]
        ev = f["evidence"]
        m = ev["metrics"]
        assert ev["training_chunk"] == 2 and 0.5 <= m["share_within_tolerance"] < MATCH_SHARE
        assert m["row_cosine_p50"] > 0.999
        dr = ev["differing_rows"]
        assert dr["differing_rows"] == m["rows"] - ev["rows_within"] > 0
        assert dr["energy_vs_median_row_p50"] > 10 and dr["share_among_highest_energy_rows"] >= 0.8
        assert dr["diff_dims"][0] == dim and dr["diff_dims_share"] > 0.9
        assert all(p == 0 or t in w.target.config.delimiters for p, t in zip(dr["positions"], dr["token_ids"]))
        assert "one of them is wrong" not in f["detail"] and "not another layer" in f["detail"]


@pytest.mark.parametrize("use_ref", [False, True])
def test_rows_under_other_samples_tokens_withhold_layer_findings(worlds, use_ref):
    """Served rows of sample k+1 under sample k's prompt ids (a shifted file; two prompts also differ in length,
    so the ids disagree there): the rows are not aligned, so no layer finding is built on them; the token_mismatch
    finding says so and keeps what was withheld as evidence."""
    w = worlds[32]
    ids, train, dd, td = _case(w, 32)
    clean = json.loads(Path(w.served_json(outs(ids))).read_text())
    shifted = []
    for k, r in enumerate(clean):
        o = clean[(k + 1) % len(clean)]
        r = json.loads(json.dumps(r))
        r["meta_info"]["hidden_states"], r["output_ids"] = o["meta_info"]["hidden_states"], o["output_ids"]
        n = len(o["prompt_token_ids"])
        r["prompt_token_ids"] = (clean[k]["prompt_token_ids"] + [0] * n)[:n]
        shifted.append(r)
    path = w.sub("shifted") / "served.json"
    path.write_text(json.dumps(shifted))
    d = diagnose(train, [path], draft_config=dd, target_config=td, reference=w.reference() if use_ref else None)
    assert kinds(d) == [("token_mismatch", -1)], d.render_text()
    f = d.findings[0]
    ev = f["evidence"]
    assert ev["count"] >= 1 and ev["rows_in_mismatched_samples"] > 0
    assert {h["kind"] for h in ev["withheld_findings"]} <= {"wrong_layer", "unidentified_chunk"}
    assert len(ev["withheld_findings"]) == 3 and "withheld" in f["detail"]
    assert all(v["share_within_tolerance"] < 0.5 for v in ev["mismatched_rows_vs_same_training_chunk"].values())


def test_massive_dims_zeroed_on_every_row_is_a_partial_match_on_those_dims(worlds):
    """Both massive-activation dims zeroed on every row of every chunk: leaving those dims out the rows are equal,
    so each chunk is the right tensor with two dims altered, never a wrong layer."""
    w = worlds[32]
    ids, train, dd, td = _case(w, 32)
    mi = w.target.massive_idx.tolist()

    def zero_dims(x):
        x = x.clone()
        x[:, mi] = 0
        return x
    d = diagnose(train, [w.served_json(outs(ids), mutate=_chunk_map(zero_dims, [0, 1, 2]))], draft_config=dd,
                 target_config=td)
    assert kinds(d) == [("partial_match", c) for c in range(3)], d.render_text()
    for f in d.findings:
        dp = f["evidence"]["differing_dims"]
        assert sorted(dp["dims"]) == sorted(mi) and dp["share_within_without_dims"] >= MATCH_SHARE
        assert f["evidence"]["metrics"]["share_within_tolerance"] < 0.5
        assert "one of them is wrong" not in f["detail"]


def test_a_negative_scale_says_the_rows_point_the_opposite_way(worlds):
    w = worlds[32]
    ids, train, dd, td = _case(w, 32)
    d = diagnose(train, [w.served_json(outs(ids), mutate=_chunk_map(lambda x: -3 * x, [1]))], draft_config=dd,
                 target_config=td)
    assert kinds(d) == [("scaled_chunk", 1)], d.render_text()
    assert abs(d.findings[0]["evidence"]["factor"] + 3) < 0.03 and "opposite way" in d.findings[0]["detail"]


@pytest.mark.parametrize("n", [32, 61])
def test_a_manifest_the_data_contradict_gives_way_to_the_data(worlds, n):
    """The training data hold the default layers but their manifest was edited to ids + 1 (the draft config and the
    server are right): without a reference the manifest is all there is (config_ids_mismatch, offsets); with the
    every-layer reference the training chunks are identified, their plan replaces the manifest's, the static check
    is run against it (no config_ids_mismatch, no offset) and a note says the manifest does not describe the data."""
    w = worlds[n]
    ids = specforge_default(n)
    served = w.served_json(outs(ids))
    dd, td = w.configs(ids)
    lying = w.training(outs(ids), manifest_ids=[i + 1 for i in ids])
    d = diagnose(lying, [served], draft_config=dd, target_config=td)
    assert ("config_ids_mismatch", -1) in kinds(d), d.render_text()
    d2 = diagnose(lying, [served], draft_config=dd, target_config=td, reference=w.reference())
    assert kinds(d2) == [], d2.render_text()
    assert d2.training_plan.provenance == "inferred" and d2.training_plan.tensors == outs(ids)
    assert any("the manifest does not describe this data" in x for x in d2.notes)
