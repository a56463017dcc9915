"""Diagnosis cases built from a real tiny HF Llama: training data through HF hidden states in SpecForge /
speculators layout, served data shaped like SGLang's /generate response (or per-rank dumps), chunks chosen
by SGLang's capture rules (helpers.diagnosis.conventions.served_plan)."""
from __future__ import annotations

import pytest
import torch

from support.forensic_cases import (make_samples, orthogonal, partial_rows, sharded_rows, unreduced_embedding_rows,
                                    write_generate_json, write_rank_dumps, write_reference, write_specforge,
                                    write_speculators)
from helpers.diagnosis.compare import REL_DIFF_TOLERANCE
from helpers.formats.configs import read_draft_config, read_target_config
from helpers.diagnosis.conventions import served_plan
from helpers.diagnosis.diagnose import diagnose
from helpers.formats.dumps import write_dump
from support.tinymodels import build_eagle3_draft

SPECFORGE_DEFAULT = ["out(1)", "out(3)", "out(4)"]   # [1, n//2-1, n-4] for n=8 = SGLang default [2, 4, 5]


def kinds(d) -> list[tuple]:
    return sorted((f["kind"], -1 if f["chunk"] is None else f["chunk"]) for f in d.findings)


def plan_for(draft_dir, target_dir, version=None, algorithm="EAGLE3") -> list[str]:
    return served_plan(read_draft_config(draft_dir), read_target_config(target_dir), "sglang", version,
                       algorithm).tensors


def by_kind(d, kind):
    return [f for f in d.findings if f["kind"] == kind]


# ------------------------------------------------------------------------------------------------ clean

@pytest.mark.parametrize("tp", [1, 2, 8])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_clean_configurations_give_zero_findings(tmp_path, tiny_target, tiny_draft, runner32, runner16, specs, tp,
                                                 dtype):
    runner = runner32 if dtype == "float32" else runner16
    served_tensors = plan_for(tiny_draft, tiny_target)
    assert served_tensors == SPECFORGE_DEFAULT            # ids [1,3,4] +1 -> capture [2,4,5]
    train = write_specforge(tmp_path / "train", runner, specs, SPECFORGE_DEFAULT)
    if tp == 1:
        served = [write_generate_json(tmp_path / "served.json", runner, specs, served_tensors)]
    else:
        served = write_rank_dumps(tmp_path / "ranks", runner, specs, served_tensors, tp)
    d = diagnose(train, served, draft_config=tiny_draft, target_config=tiny_target)
    assert d.findings == [], d.render_text()
    assert d.verdict == "ok"
    assert [c["matched_training_chunk"] for c in d.chunks] == [0, 1, 2]
    tol = REL_DIFF_TOLERANCE[dtype]
    assert all(0 <= c["rel_diff"] <= tol and c["cosine"] > 0.999 for c in d.chunks)
    assert d.comparison.alignment.samples_paired == 3
    assert d.comparison.alignment.decode_rows_compared == 3 * 5    # output_ids[:-1] rows, same greedy tokens
    if tp > 1 and dtype == "bfloat16":
        # TP-k reduction order really changes bf16 values: the tolerance is exercised, not bypassed
        assert max(c["rel_diff"] for c in d.chunks) > 0


# ------------------------------------------------------------------------------------------- conventions

@pytest.mark.parametrize("layout", ["speculators", "specforge"])
def test_explicit_ids_read_with_the_wrong_convention(tmp_path, tiny_target, runner32, specs, layout):
    # Draft trained on in(2), in(4), in(5) (vLLM/speculators ids [2, 4, 5]); the ids were put under
    # eagle_config, where SGLang adds +1: every chunk arrives one layer late.
    draft = build_eagle3_draft(tmp_path / "draft", tiny_target, layer_ids=[2, 4, 5])
    served_tensors = plan_for(draft, tiny_target)
    assert served_tensors == ["out(2)", "out(4)", "out(5)"]
    trained = ["out(1)", "out(3)", "out(4)"]
    if layout == "speculators":
        train = write_speculators(tmp_path / "train", runner32, specs, trained + ["out(7)"])
    else:
        train = write_specforge(tmp_path / "train", runner32, specs, trained)
    served = write_generate_json(tmp_path / "served.json", runner32, specs, served_tensors)
    d = diagnose(train, [served], draft_config=draft, target_config=tiny_target)
    assert kinds(d) == [("layer_offset", 0), ("layer_offset", 1), ("layer_offset", 2)], d.render_text()
    for f in d.findings:
        assert f["evidence"]["offset"] == 1
    ev = [f["evidence"] for f in d.findings]
    assert [e["served_identified_as"] for e in ev] == served_tensors
    assert [e["training_identified_as"] for e in ev] == trained
    if layout == "specforge":   # the SpecForge reading of the ids is wrong; the equal chunk 1 == 2 corrects it
        assert "shifted by -1" in ev[0]["training_identified_by"]
    # served chunk 1 (out(4)) equals training chunk 2 (out(4)) exactly
    assert d.chunks[1]["matched_training_chunk"] == 2 and d.chunks[1]["rel_diff"] < 1e-10
    # with the reference, every chunk is identified exactly
    ref = write_reference(tmp_path / "ref", runner32, specs)
    d2 = diagnose(train, [served], draft_config=draft, target_config=tiny_target, reference=ref)
    assert kinds(d2) == kinds(d)
    assert [c["identified_as"] for c in d2.chunks] == served_tensors
    assert all(f["evidence"]["served_identified_by"] == "reference" for f in d2.findings)


def test_gpt_oss_like_final_boundary_never_captured(tmp_path, target36, specs):
    from support.forensic_cases import TargetRunner

    runner = TargetRunner(target36, torch.float32)
    # ids [24, 30, 36] mean boundaries in(24), in(30), in(36) = out(23), out(29), out(35) on a 36-layer target.
    draft = build_eagle3_draft(tmp_path / "draft", target36, layer_ids=[24, 30, 36])
    plan = served_plan(read_draft_config(draft), read_target_config(target36), "sglang", "0.5.23")
    assert plan.tensors == ["out(24)", "out(30)"]                     # +1 -> [25, 31, 37]; 37 is never reached
    assert plan.problems[0]["kind"] == "missing_chunk"
    trained = ["out(23)", "out(29)", "out(35)"]
    train = write_specforge(tmp_path / "train", runner, specs, trained)
    served = write_generate_json(tmp_path / "served.json", runner, specs, plan.tensors)
    ref = write_reference(tmp_path / "ref", runner, specs)
    d = diagnose(train, [served], draft_config=draft, target_config=target36, reference=ref)
    assert kinds(d) == [("layer_offset", 0), ("layer_offset", 1), ("missing_chunk", -1), ("width_mismatch", -1)], \
        d.render_text()
    wm = by_kind(d, "width_mismatch")[0]["evidence"]
    assert (wm["served_width"], wm["training_width"]) == (2 * 64, 3 * 64)
    assert "static_prediction" in wm                                   # predicted from the configs alone
    miss = by_kind(d, "missing_chunk")[0]["evidence"]
    assert (miss["training_chunk"], miss["training_identified_as"]) == (2, "out(35)")
    assert [c["identified_as"] for c in d.chunks] == ["out(24)", "out(30)"]
    # without a reference the shape of the fault is still named
    d2 = diagnose(train, [served], draft_config=draft, target_config=target36)
    assert {"width_mismatch", "missing_chunk"} <= {f["kind"] for f in d2.findings}


def test_draft_without_ids_falls_back_to_default_but_training_used_others(tmp_path, tiny_target, runner32, specs):
    draft = build_eagle3_draft(tmp_path / "draft", tiny_target, layer_ids=None)
    served_tensors = plan_for(draft, tiny_target)
    assert served_tensors == SPECFORGE_DEFAULT                         # default [2, n//2, n-3], no +1
    trained = ["out(1)", "out(3)", "out(5)"]                           # SpecForge run override [1, 3, 5], not persisted
    train = write_specforge(tmp_path / "train", runner32, specs, trained)
    served = write_generate_json(tmp_path / "served.json", runner32, specs, served_tensors)
    ref = write_reference(tmp_path / "ref", runner32, specs)
    d = diagnose(train, [served], draft_config=draft, target_config=tiny_target, reference=ref)
    assert kinds(d) == [("wrong_layer", 2)], d.render_text()
    ev = d.findings[0]["evidence"]
    assert (ev["served_identified_as"], ev["training_identified_as"], ev["offset"]) == ("out(4)", "out(5)", -1)
    assert [c["matched_training_chunk"] for c in d.chunks] == [0, 1, None]
    # the reference identifies every training chunk: the training plan is inferred from the data, and the
    # default plan the configs implied (SpecForge's default: not recorded anywhere) is kept as a note
    assert d.training_plan.provenance == "inferred" and d.training_plan.tensors == trained
    assert any("default" in n for n in d.training_plan.notes)
    assert any("falls back to" in a for a in d.static.advisories)


def test_eagle3_draft_served_with_algorithm_eagle(tmp_path, tiny_target, tiny_draft, runner32, specs):
    served_tensors = plan_for(tiny_draft, tiny_target, algorithm="EAGLE")
    assert served_tensors == ["final_norm"]
    train = write_specforge(tmp_path / "train", runner32, specs, SPECFORGE_DEFAULT)
    samples = [{"key": f"req{i}", "input_ids": sp.served_ids, "hidden": runner32.rows(sp.served_ids, served_tensors),
                "output_ids": sp.output_ids, "num_prompt_tokens": len(sp.prompt)} for i, sp in enumerate(specs)]
    served = write_dump(tmp_path / "served", samples, {
        "kind": "served", "hidden_size": 64, "sglang_version": "0.5.23",
        "server": {"speculative_algorithm": "EAGLE", "speculative_num_steps": 3, "speculative_eagle_topk": 1,
                   "speculative_num_draft_tokens": 4, "tp_size": 1}})
    ref = write_reference(tmp_path / "ref", runner32, specs)
    d = diagnose(train, [served], draft_config=tiny_draft, target_config=tiny_target, reference=ref)
    assert kinds(d) == [("fc_bypassed", -1)], d.render_text()
    ev = d.findings[0]["evidence"]
    assert (ev["served_width"], ev["fc_in_features"], ev["draft_hidden_size"]) == (64, 192, 64)
    assert ev["served_identified_as"] == "final_norm"
    assert ev["static_prediction"]["speculative_algorithm"] == "EAGLE"
    # the same served rows as a plain /generate JSON (no server settings): the numeric side alone finds it
    js = write_generate_json(tmp_path / "s.json", runner32, specs, served_tensors)
    d2 = diagnose(train, [js], draft_config=tiny_draft, target_config=tiny_target)
    assert kinds(d2) == [("fc_bypassed", -1)]


@pytest.mark.parametrize("write_ths", [True, False])
def test_draft_hidden_size_differs_from_target(tmp_path, tiny_target, runner32, specs, write_ths):
    draft = build_eagle3_draft(tmp_path / "draft", tiny_target, layer_ids=[1, 3, 4], hidden=32,
                               write_target_hidden_size=write_ths)
    train = write_specforge(tmp_path / "train", runner32, specs, SPECFORGE_DEFAULT)
    served = write_generate_json(tmp_path / "s.json", runner32, specs, plan_for(draft, tiny_target))
    d = diagnose(train, [served], draft_config=draft, target_config=tiny_target)
    assert [c["width"] for c in d.chunks] == [64, 64, 64]               # chunks are target-hidden wide
    if write_ths:
        assert d.findings == [], d.render_text()
    else:   # SGLang builds Linear(3 * hidden_size=96) but fc.weight is [32, 192]
        assert kinds(d) == [("width_mismatch", -1)], d.render_text()
        ev = d.findings[0]["evidence"]
        assert (ev["fc_in_features"], ev["sglang_fc_in_features"]) == (192, 96)


# --------------------------------------------------------------------------------------------------- TP

@pytest.mark.parametrize("tp", [2, 8])
def test_per_rank_partial_sums(tmp_path, tiny_target, tiny_draft, runner32, specs, tp):
    train = write_specforge(tmp_path / "train", runner32, specs, SPECFORGE_DEFAULT)
    served = write_rank_dumps(tmp_path / "ranks", runner32, specs, SPECFORGE_DEFAULT, tp,
                              rank_rows=partial_rows(runner32, SPECFORGE_DEFAULT, tp))
    d = diagnose(train, served, draft_config=tiny_draft, target_config=tiny_target)
    assert kinds(d) == [("tp_partial_sum", 0), ("tp_partial_sum", 1), ("tp_partial_sum", 2)], d.render_text()
    for f in d.findings:
        ev = f["evidence"]
        assert ev["tp_size"] == tp and ev["training_chunk"] == f["chunk"]
        assert ev["sum_metrics"]["rel_diff"] <= REL_DIFF_TOLERANCE["float32"]
        assert min(ev["per_rank_rel_diff"].values()) > 1e-3
        assert len(ev["per_rank_rel_diff"]) == tp


def test_tp_sharded_width(tmp_path, tiny_target, tiny_draft, runner32, specs):
    train = write_specforge(tmp_path / "train", runner32, specs, SPECFORGE_DEFAULT)
    served = write_rank_dumps(tmp_path / "ranks", runner32, specs, SPECFORGE_DEFAULT, 2,
                              rank_rows=sharded_rows(runner32, SPECFORGE_DEFAULT, 2))
    d = diagnose(train, served, draft_config=tiny_draft, target_config=tiny_target)
    assert kinds(d) == [("tp_sharded_width", -1)], d.render_text()
    ev = d.findings[0]["evidence"]
    assert (ev["served_width"], ev["chunk_width"], ev["shard_factor"]) == (96, 32, 2)
    assert ev["slices"]["rank1/chunk2"]["training_unit"] == "t2[r1]" and ev["slices"]["rank1/chunk2"]["passed"]
    assert all(g["passed"] for g in ev["gathered"].values())


@pytest.mark.parametrize("ranks", ["all", "one"])
def test_embedding_not_all_reduced(tmp_path, tiny_target, runner32, specs, ranks):
    # a trainer that did capture the embedding (e.g. the seed hunt's belief) + a capture taken on each rank
    # before VocabParallelEmbedding's all-reduce
    tensors = ["embedding", "out(1)", "out(3)"]
    draft = build_eagle3_draft(tmp_path / "draft", tiny_target, layer_ids=[-1, 1, 3])
    assert plan_for(draft, tiny_target, "0.5.23") == tensors
    train = write_specforge(tmp_path / "train", runner32, specs, tensors)
    served = write_rank_dumps(tmp_path / "ranks", runner32, specs, tensors, 8,
                              rank_rows=unreduced_embedding_rows(runner32, tensors, 8))
    if ranks == "one":
        served = [served[5]]
    d = diagnose(train, served, draft_config=draft, target_config=tiny_target)
    assert kinds(d) == [("embedding_not_all_reduced", 0)], d.render_text()
    ev = by_kind(d, "embedding_not_all_reduced")[0]["evidence"]
    assert all(r["consistent_with_shard"] for r in ev["ranks"])
    assert all(r["zero_rows"] > 0 for r in ev["ranks"])
    if ranks == "all":
        assert ev["sum_over_ranks_best_training_chunk"] == {"chunk": 0, "rel_diff": 0.0, "passed": True} or \
            ev["sum_over_ranks_best_training_chunk"]["passed"]
        assert {r["tp_rank"] for r in ev["ranks"]} >= {2, 3, 4, 5}
    else:
        assert [r["tp_rank"] for r in ev["ranks"]] == [5]
        assert ev["ranks"][0]["expected_shard"] == [240, 287]


# ---------------------------------------------------------------------------------------------- vocab

def test_pruned_vocab_without_d2t(tmp_path, tiny_target, runner32, specs):
    draft = build_eagle3_draft(tmp_path / "draft", tiny_target, layer_ids=[1, 3, 4], draft_vocab=256, with_d2t=False)
    train = write_specforge(tmp_path / "train", runner32, specs, SPECFORGE_DEFAULT)
    served = write_generate_json(tmp_path / "s.json", runner32, specs, plan_for(draft, tiny_target))
    d = diagnose(train, [served], draft_config=draft, target_config=tiny_target)
    assert kinds(d) == [("vocab_map_missing", -1)], d.render_text()
    ev = d.findings[0]["evidence"]
    assert (ev["draft_vocab_size"], ev["vocab_size"], ev["t2d_present"]) == (256, 384, False)


# ------------------------------------------------------------------------------------------------ NaN

def test_nan_rows(tmp_path, tiny_target, tiny_draft, runner32, specs):
    def poison(i, rows):
        if i == 1:
            rows = rows.clone()
            rows[[3, 7], 64 + 5] = float("nan")         # chunk 1, two rows
            rows[10, 2] = float("inf")                  # chunk 0, one row
        return rows
    train = write_specforge(tmp_path / "train", runner32, specs, SPECFORGE_DEFAULT)
    served = write_generate_json(tmp_path / "s.json", runner32, specs, SPECFORGE_DEFAULT, mutate=poison)
    # SGLang's orjson writes NaN/Inf as null (srt/utils/json_response.py)
    text = served.read_text().replace("NaN", "null").replace("Infinity", "null")
    served.write_text(text)
    assert "null" in text
    d = diagnose(train, [served], draft_config=tiny_draft, target_config=tiny_target)
    assert kinds(d) == [("nan_or_inf", 0), ("nan_or_inf", 1)], d.render_text()
    ev = {f["chunk"]: f["evidence"] for f in d.findings}
    assert ev[1]["rows"] == 2 and ev[0]["rows"] == 1
    assert [a["row"] for a in ev[1]["first"]] == [3, 7] and ev[1]["first"][0]["sample"] == "req1"
    assert all(c["matched_training_chunk"] == c["index"] for c in d.chunks)   # other rows still compared


# ------------------------------------------------------------------------------------------ the seeds

@pytest.mark.parametrize("tp", [1, 8])
def test_seed_case_embedding_in_place_of_first_chunk(tmp_path, tiny_target, runner32, specs, tp):
    # Kimi-K2.5 hunt: trained on [2, 30, 58] (SpecForge out(i)); a patch + config [-1, 2, 30] fed
    # [embedding, out(2), out(30)]: same total width. Tiny analogue: trained [1, 3, 5], config [-1, 1, 3].
    draft = build_eagle3_draft(tmp_path / "draft", tiny_target, layer_ids=[-1, 1, 3])
    plan = served_plan(read_draft_config(draft), read_target_config(tiny_target), "sglang", "0.5.23")
    assert plan.tensors == ["embedding", "out(1)", "out(3)"] and plan.fatal is None
    trained = ["out(1)", "out(3)", "out(5)"]
    train = write_specforge(tmp_path / "train", runner32, specs, trained)
    if tp == 1:
        served = [write_generate_json(tmp_path / "s.json", runner32, specs, plan.tensors)]
    else:
        served = write_rank_dumps(tmp_path / "ranks", runner32, specs, plan.tensors, tp)
    ref = write_reference(tmp_path / "ref", runner32, specs)
    for reference in (None, ref):
        d = diagnose(train, served, draft_config=draft, target_config=tiny_target, reference=reference)
        assert kinds(d) == [("chunk_order", -1), ("embedding_in_place_of_layer", 0), ("missing_chunk", -1)], \
            d.render_text()
        emb = by_kind(d, "embedding_in_place_of_layer")[0]["evidence"]
        assert emb["repeated_token_pairs"] > 0 and emb["repeated_token_max_rel_diff"] == 0.0
        assert emb["training_chunks_context_free"] == [False, False, False]
        assert emb["training_identified_as"] == "out(1)"
        assert by_kind(d, "chunk_order")[0]["evidence"]["mapping"] == {"1": 0, "2": 1}
        assert by_kind(d, "missing_chunk")[0]["evidence"]["training_chunk"] == 2
        assert d.chunks[0]["identified_as"] == "embedding"
        assert d.comparison.training_width == d.comparison.served_width == 192   # same total width
    assert by_kind(d, "missing_chunk")[0]["evidence"]["training_identified_as"] == "out(5)"


# ---------------------------------------------------------------------------------- other fault kinds

def test_unsorted_training_ids_give_chunk_order(tmp_path, tiny_target, runner32, specs):
    # SpecForge's HF backend (Dec 2025 - Jun 2026) concatenated in list order; SGLang in ascending order
    draft = build_eagle3_draft(tmp_path / "draft", tiny_target, layer_ids=[4, 1, 3])
    assert plan_for(draft, tiny_target) == SPECFORGE_DEFAULT
    train = write_specforge(tmp_path / "train", runner32, specs, ["out(4)", "out(1)", "out(3)"])
    served = write_generate_json(tmp_path / "s.json", runner32, specs, SPECFORGE_DEFAULT)
    d = diagnose(train, [served], draft_config=draft, target_config=tiny_target)
    assert kinds(d) == [("chunk_order", -1)], d.render_text()
    ev = d.findings[0]["evidence"]
    assert ev["mapping"] == {"0": 1, "1": 2, "2": 0} and ev["permutation"] is True


def test_extra_chunk(tmp_path, tiny_target, runner32, specs):
    draft = build_eagle3_draft(tmp_path / "draft", tiny_target, layer_ids=[1, 3, 4, 6])
    served_tensors = plan_for(draft, tiny_target)
    assert served_tensors == ["out(1)", "out(3)", "out(4)", "out(6)"]
    train = write_specforge(tmp_path / "train", runner32, specs, SPECFORGE_DEFAULT)
    served = write_generate_json(tmp_path / "s.json", runner32, specs, served_tensors)
    d = diagnose(train, [served], draft_config=draft, target_config=tiny_target)
    # numeric: 4 served vs 3 trained; draft side: 4 nested ids make SGLang build Linear(256) for a [64, 192] fc
    assert kinds(d) == [("extra_chunk", 3), ("width_mismatch", -1), ("width_mismatch", -1)], d.render_text()
    assert {f["evidence"].get("sglang_fc_in_features") for f in by_kind(d, "width_mismatch")} == {None, 256}


def test_rotated_basis(tmp_path, tiny_target, tiny_draft, runner32, specs):
    Q = orthogonal(64).float()

    def rotate(i, rows):
        rows = rows.clone()
        rows[:, 64:128] = rows[:, 64:128] @ Q
        return rows
    train = write_specforge(tmp_path / "train", runner32, specs, SPECFORGE_DEFAULT)
    served = write_generate_json(tmp_path / "s.json", runner32, specs, SPECFORGE_DEFAULT, mutate=rotate)
    d = diagnose(train, [served], draft_config=tiny_draft, target_config=tiny_target)
    assert kinds(d) == [("rotated_basis", 1)], d.render_text()
    m = d.findings[0]["evidence"]["metrics"]
    assert abs(m["row_norm_ratio_min"] - 1) < 1e-5 and abs(m["row_norm_ratio_max"] - 1) < 1e-5
    assert abs(m["cosine"]) < 0.5


def test_norm_mismatch(tmp_path, tiny_target, tiny_draft, runner32, specs):
    def post_norm(i, rows):   # chunk 2 fed through an RMSNorm (e.g. a norm moved from the draft to the capture)
        rows = rows.clone()
        x = rows[:, 128:]
        rows[:, 128:] = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return rows
    train = write_specforge(tmp_path / "train", runner32, specs, SPECFORGE_DEFAULT)
    served = write_generate_json(tmp_path / "s.json", runner32, specs, SPECFORGE_DEFAULT, mutate=post_norm)
    d = diagnose(train, [served], draft_config=tiny_draft, target_config=tiny_target)
    assert kinds(d) == [("norm_mismatch", 2)], d.render_text()
    m = d.findings[0]["evidence"]["metrics"]
    assert m["min_row_cosine"] > 0.99999 and abs(m["norm_ratio"] - 1) > 0.1
    assert m["row_norm_ratio_max"] - m["row_norm_ratio_min"] > 0.05      # a per-row rescaling, not one factor


def test_token_mismatch(tmp_path, tiny_target, tiny_draft, runner32, specs):
    from support.forensic_cases import SampleSpec

    bad = [specs[0], SampleSpec(prompt=specs[1].prompt[:5] + [300] + specs[1].prompt[6:],
                                continuation=specs[1].continuation, output_ids=specs[1].output_ids), specs[2]]
    train = write_specforge(tmp_path / "train", runner32, specs, SPECFORGE_DEFAULT)
    served = write_generate_json(tmp_path / "s.json", runner32, bad, SPECFORGE_DEFAULT)
    d = diagnose(train, [served], draft_config=tiny_draft, target_config=tiny_target)
    assert kinds(d) == [("token_mismatch", -1)], d.render_text()
    mm = d.findings[0]["evidence"]["mismatches"][0]
    assert (mm["position"], mm["served_token_id"], mm["rows_compared"]) == (5, 300, 5)
    assert mm["training_token_id"] == specs[1].prompt[5]


def test_config_ids_ignored(tmp_path, tiny_target, runner32, specs):
    draft = build_eagle3_draft(tmp_path / "draft", tiny_target, layer_ids=[1, 3, 5], nested=False)
    served_tensors = plan_for(draft, tiny_target)
    assert served_tensors == SPECFORGE_DEFAULT                     # top-level ids ignored -> default
    train = write_specforge(tmp_path / "train", runner32, specs, ["out(1)", "out(3)", "out(5)"])
    served = write_generate_json(tmp_path / "s.json", runner32, specs, served_tensors)
    d = diagnose(train, [served], draft_config=draft, target_config=tiny_target)
    assert kinds(d) == [("config_ids_ignored", -1), ("wrong_layer", 2)], d.render_text()
    ev = by_kind(d, "config_ids_ignored")[0]["evidence"]
    assert ev["meant"] == ["out(1)", "out(3)", "out(5)"] and ev["served"] == SPECFORGE_DEFAULT


def test_num_draft_tokens_overridden(tmp_path, tiny_target, tiny_draft, runner32, specs):
    train = write_specforge(tmp_path / "train", runner32, specs, SPECFORGE_DEFAULT)
    samples = [{"key": f"req{i}", "input_ids": sp.served_ids, "hidden": runner32.rows(sp.served_ids, SPECFORGE_DEFAULT),
                "output_ids": sp.output_ids, "num_prompt_tokens": len(sp.prompt)} for i, sp in enumerate(specs)]
    server = {"effective": {"speculative_algorithm": "EAGLE3", "speculative_num_steps": 3,
                            "speculative_eagle_topk": 1, "speculative_num_draft_tokens": 4, "tp_size": 1},
              "requested": {"speculative_algorithm": "EAGLE3", "speculative_num_steps": 3,
                            "speculative_eagle_topk": 1, "speculative_num_draft_tokens": 8},
              "version": "0.5.23"}
    served = write_dump(tmp_path / "served", samples, {"kind": "served", "hidden_size": 64, "server": server})
    d = diagnose(train, [served], draft_config=tiny_draft, target_config=tiny_target)
    assert kinds(d) == [("num_draft_tokens_overridden", -1)], d.render_text()
    ev = d.findings[0]["evidence"]
    assert (ev["requested"], ev["effective"]) == (8, 4)


def test_num_draft_tokens_overridden_from_a_flat_server_info_launch_command(tiny_target, tiny_draft):
    """A live investigation passes /server_info as it comes (flat, effective values only): SGLang's own
    launch_command in it says what was asked (the seeds' silent override: 16 draft tokens asked at topk 1)."""
    from helpers.diagnosis.static import static_check
    from helpers.server.settings import ServerSettings

    info = {"speculative_algorithm": "EAGLE3", "speculative_num_steps": 3, "speculative_eagle_topk": 1,
            "speculative_num_draft_tokens": 4, "tp_size": 2, "version": "0.5.23",
            "launch_command": "python -m sglang.launch_server --model-path /t --tp-size 2 --speculative-algorithm "
                              "EAGLE3 --speculative-num-steps 3 --speculative-eagle-topk 1 "
                              "--speculative-num-draft-tokens 16 --api-key s3cret"}
    s = ServerSettings.from_dict(info)
    assert s.requested["speculative_num_draft_tokens"] == 16 and s.num_draft_tokens == 4
    assert "api_key" not in s.requested
    rep = static_check(tiny_draft, tiny_target, server=info)
    ov = [f for f in rep.findings if f["kind"] == "num_draft_tokens_overridden"]
    assert len(ov) == 1 and (ov[0]["evidence"]["requested"], ov[0]["evidence"]["effective"]) == (16, 4)
    # asked as run, a count that is no integer, an unreadable command, or a requested block: nothing is inferred
    for cmd in ("--speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4",
                "--speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens x16",
                "--speculative-num-draft-tokens '16"):
        rep = static_check(tiny_draft, tiny_target, server={**info, "launch_command": cmd})
        assert not [f for f in rep.findings if f["kind"] == "num_draft_tokens_overridden"], cmd
    assert ServerSettings.from_dict({"effective": info, "requested": {}}).requested == {}


# ---------------------------------------------------------------------------------- response layouts

def test_cached_prefix_and_missing_prompt_ids(tmp_path, tiny_target, tiny_draft, runner32, specs):
    train = write_specforge(tmp_path / "train", runner32, specs, SPECFORGE_DEFAULT, compress=True)
    # radix-cache hit: the prompt block holds only the last P-5 prompt rows
    s1 = write_generate_json(tmp_path / "cached.json", runner32, specs, SPECFORGE_DEFAULT, cached=5)
    d = diagnose(train, [s1], draft_config=tiny_draft, target_config=tiny_target)
    assert d.findings == [], d.render_text()
    rows = sum(len(sp.served_ids) - 5 for sp in specs)
    assert d.comparison.alignment.rows_compared == rows
    # no prompt_token_ids: aligned by training-sample order
    s2 = write_generate_json(tmp_path / "noids.json", runner32, specs, SPECFORGE_DEFAULT, with_prompt_ids=False)
    d2 = diagnose(train, [s2], draft_config=tiny_draft, target_config=tiny_target)
    assert d2.findings == [] and d2.comparison.alignment.paired_by == {"order": 3}


def test_sglang_dumper_folder_as_served(tmp_path, tiny_target, tiny_draft, runner32, specs):
    """Per-rank aux states written in SGLang dumper's {"value", "meta"} format (one extend step per request,
    with the non-intrusive core input_ids/positions dumps) are read and aligned like any served source."""
    exp = tmp_path / "dumper" / "dump_20260101_000000"
    exp.mkdir(parents=True)
    for rank in (0, 1):
        k = 0
        for step, sp in enumerate(specs):
            ids = torch.tensor(sp.prompt)
            rows = runner32.rows(sp.prompt, SPECFORGE_DEFAULT, tp=2)
            for name, v in (("input_ids", ids), ("positions", torch.arange(len(ids))), ("aux_hidden_states", rows)):
                k += 1
                meta = {"step": step, "rank": rank, "dump_index": k, "name": name, "world_rank": rank,
                        "world_size": 2, "sglang_parallel_info": {"tp_rank": rank, "tp_size": 2}}
                torch.save({"value": v, "meta": meta},
                           exp / f"step={step}___rank={rank}___dump_index={k}___name={name}.pt")
    train = write_specforge(tmp_path / "train", runner32, specs, SPECFORGE_DEFAULT)
    d = diagnose(train, [tmp_path / "dumper"], draft_config=tiny_draft, target_config=tiny_target)
    assert d.findings == [], d.render_text()
    assert [s.name for s in d.comparison.rank_sources] == ["rank0", "rank1"]
    assert d.comparison.alignment.rows_compared == sum(len(sp.prompt) for sp in specs)


def test_max_samples_below_the_served_samples_raises_no_finding(tmp_path, tiny_target, tiny_draft, runner32, specs):
    """Reading only the first training sample (03_compare's max_samples) leaves the other served samples out with a
    note; a served sample that matches no training sample when all were read is still a token_mismatch."""
    served_tensors = plan_for(tiny_draft, tiny_target)
    train = write_specforge(tmp_path / "train", runner32, specs, SPECFORGE_DEFAULT)
    served = write_generate_json(tmp_path / "served.json", runner32, specs, served_tensors)
    d = diagnose(train, [served], draft_config=tiny_draft, target_config=tiny_target, max_samples=1)
    assert d.findings == [], d.render_text()
    assert d.comparison.alignment.samples_paired == 1
    assert any("2 served sample(s) were not compared" in n for n in d.notes), d.notes
    # all training samples read, one served sample from elsewhere: a finding
    other = write_generate_json(tmp_path / "other.json", runner32, specs[:2] + make_samples(runner32, 4)[3:],
                                served_tensors)
    d = diagnose(train, [other], draft_config=tiny_draft, target_config=tiny_target)
    assert [f["kind"] for f in d.findings] == ["token_mismatch"], d.render_text()
