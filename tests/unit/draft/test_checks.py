"""helpers.draft.checks on the reference draft and on damaged copies of it (real tensors, real configs): each check
must stay silent on the clean draft and name the damage, with its numbers, on the copy."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers.diagnosis.detectors import FINDING_KINDS
from helpers.draft.checks import draft_checks, inspect_draft
from helpers.errors import BadInput
from helpers.paths import REFERENCE_DRAFT, REFERENCE_TARGET, REFERENCE_TRAINING

WEIGHTS = "model.safetensors"


def damaged(tmp_path, *, config=None, drop=(), replace=None, name="draft"):
    """A copy of the reference draft with its config edited by ``config(cfg)``, tensors dropped / replaced."""
    out = tmp_path / name
    shutil.copytree(REFERENCE_DRAFT, out)
    if config is not None:
        cfg = json.loads((out / "config.json").read_text())
        config(cfg)
        (out / "config.json").write_text(json.dumps(cfg, indent=2))
    if drop or replace:
        t = load_file(out / WEIGHTS)
        for k in drop:
            del t[k]
        t.update(replace or {})
        save_file(t, out / WEIGHTS, metadata={"format": "pt"})
    return out


def ref_tensor(key):
    return load_file(REFERENCE_DRAFT / WEIGHTS)[key]


def hot_ids():
    d2t = ref_tensor("d2t")
    return (d2t + torch.arange(d2t.numel())).numpy()


#: loss-masked tokens of the reference training sample, as its capture.json records them (the .ckpt files are read
#: by training_tokens, independently)
MASKED = json.loads((REFERENCE_TRAINING / "capture.json").read_text())["loss_masked_tokens"]


def training_tokens():
    """The loss-masked token ids of the reference training sample, read straight from the .ckpt files."""
    toks = []
    for f in sorted(REFERENCE_TRAINING.rglob("data_*.ckpt")):
        d = torch.load(f, weights_only=True)
        ids, lm = d["input_ids"].flatten(), d["loss_mask"].flatten()
        toks.append(ids[lm == 1].numpy())
    return np.concatenate(toks)


def kinds(findings):
    return [f["kind"] for f in findings]


def one(findings, kind):
    got = [f for f in findings if f["kind"] == kind]
    assert len(got) == 1, kinds(findings)
    return got[0]


def test_reference_draft_is_clean_and_its_facts_are_right():
    out = inspect_draft(REFERENCE_DRAFT, REFERENCE_TARGET, REFERENCE_TRAINING)
    assert out["findings"] == []
    facts = out["facts"]
    assert facts["lm_head"]["source"] == "the draft checkpoint" and facts["lm_head"]["rows"] == 2048
    assert facts["vocab"]["map"] == "d2t" and facts["vocab"]["differing_share"] == 0.0
    assert facts["vocab"]["training_mapping"].endswith("vocab_mapping/vocab_mapping.pt")
    assert facts["fc"]["in_features"] == 384 and facts["fc"]["num_aux"] == 3
    ctx = facts["context_length"]
    assert (ctx["draft"], ctx["target"], ctx["served"], ctx["start"]) == (512, 512, 512, "ok")
    assert ctx["draft_field"] == ctx["target_field"] == "max_position_embeddings"
    assert facts["rope"]["differs_from_target"] == {} and facts["rope"]["sglang_changes"] == {}
    assert out["notes"] == []
    toks = training_tokens()
    outside = int((~np.isin(toks, hot_ids())).sum())
    cov = facts["coverage"]
    assert cov["tokens"] == toks.size == MASKED and cov["outside"] == outside
    assert cov["ceiling_p_accept_ge"][0] == pytest.approx(1 - outside / toks.size)
    # the same through the public list-only API, and with the user's tokens instead of the training data
    assert draft_checks(REFERENCE_DRAFT, REFERENCE_TARGET, REFERENCE_TRAINING) == []
    assert draft_checks(REFERENCE_DRAFT, REFERENCE_TARGET, target_tokens=toks.tolist()) == []
    assert draft_checks(REFERENCE_DRAFT) == []


def test_new_kinds_are_declared():
    for k in ("lm_head_missing", "lm_head_replaced", "vocab_map_trivial", "vocab_map_differs", "draft_vocab_coverage",
              "draft_weight_missing", "draft_weight_ignored", "draft_flag_ignored", "rope_mismatch",
              "max_position_short", "sliding_window_ignored"):
        assert k in FINDING_KINDS


# ----------------------------------------------------------------------------------------------- lm_head

def test_dropped_lm_head_is_missing_not_borrowed(tmp_path):
    d = damaged(tmp_path, drop=["lm_head.weight"])
    out = inspect_draft(d, REFERENCE_TARGET)
    f = one(out["findings"], "lm_head_missing")
    assert kinds(out["findings"]) == ["lm_head_missing"]
    assert f["evidence"]["draft_vocab_size"] == 2048 and "l. 305-314" in f["evidence"]["source"]
    assert out["facts"]["lm_head"]["source"].startswith("none")


def test_full_vocab_draft_without_lm_head_borrows_the_targets_and_says_from_what(tmp_path):
    def cfg(c):
        del c["draft_vocab_size"]
    d = damaged(tmp_path, config=cfg, drop=["lm_head.weight", "d2t", "t2d"])
    out = inspect_draft(d, REFERENCE_TARGET)
    assert out["findings"] == []
    # the reference target ties its lm_head to the embedding (tie_word_embeddings: true)
    assert out["facts"]["lm_head"]["source"] == "the target's input embedding (the target ties its lm_head to it)"
    assert out["facts"]["lm_head"]["rows"] == 4096
    assert out["facts"]["vocab"]["map"].startswith("none needed")


def test_trained_lm_head_with_draft_vocab_size_absent_cannot_load(tmp_path):
    def cfg(c):
        del c["draft_vocab_size"]
    d = damaged(tmp_path, config=cfg)
    with pytest.raises(BadInput) as e:
        draft_checks(d, REFERENCE_TARGET)
    msg = str(e.value)
    assert str(d / WEIGHTS) in msg and "[lm_head.weight]" in msg and "[2048, 128]" in msg and "[4096, 128]" in msg
    assert "draft_vocab_size is absent" in msg and "\n" not in msg


def test_tied_draft_drops_its_trained_lm_head(tmp_path):
    d = damaged(tmp_path, config=lambda c: c.update(tie_word_embeddings=True))
    out = inspect_draft(d, REFERENCE_TARGET)
    f = one(out["findings"], "lm_head_replaced")
    assert f["evidence"]["tensors"] == ["lm_head.weight"] and f["evidence"]["shape"] == [2048, 128]
    assert "target's input embedding" in f["evidence"]["used_instead"]


# ------------------------------------------------------------------------------------------------- d2t

def test_zero_d2t_is_trivial_and_its_coverage_is_measured(tmp_path):
    d = damaged(tmp_path, replace={"d2t": torch.zeros(2048, dtype=torch.int64)})
    out = inspect_draft(d, REFERENCE_TARGET, REFERENCE_TRAINING)
    f = one(out["findings"], "vocab_map_trivial")
    assert f["evidence"]["draft_vocab_size"] == 2048 and f["evidence"]["vocab_size"] == 4096
    # training's map against all zeros: every draft id whose training offset is not 0 differs
    train_d2t = torch.load(REFERENCE_TRAINING / "vocab_mapping" / "vocab_mapping.pt", weights_only=True)["d2t"]
    assert out["facts"]["vocab"]["differing_share"] == pytest.approx(float((train_d2t != 0).double().mean()))
    # the draft vocab is now target ids 0..2047: the share of training tokens at or above 2048 can never be drafted
    toks = training_tokens()
    share = float((toks >= 2048).mean())
    cov = out["facts"]["coverage"]
    assert cov["outside_share"] == pytest.approx(share) and cov["ceiling_p_accept_ge"][0] == pytest.approx(1 - share)
    assert cov["outside"] == int((toks >= 2048).sum()) and cov["tokens"] == MASKED
    # on this sample most of the target's tokens are below 2048 (73 of 1536 are not): under the 10 % limit
    assert share < 0.10 and "draft_vocab_coverage" not in kinds(out["findings"])


def test_permuted_d2t_differs_from_the_training_mapping(tmp_path):
    hot = torch.as_tensor(hot_ids())
    perm = torch.arange(2048)
    perm[0:200:2], perm[1:200:2] = torch.arange(1, 200, 2), torch.arange(0, 200, 2)   # swap 100 neighbour pairs
    d2t = hot[perm] - torch.arange(2048)
    d = damaged(tmp_path, replace={"d2t": d2t})
    out = inspect_draft(d, REFERENCE_TARGET, REFERENCE_TRAINING)
    assert kinds(out["findings"]) == ["vocab_map_differs"]
    ev = out["findings"][0]["evidence"]
    assert ev["differing_share"] == pytest.approx(200 / 2048)
    assert ev["target_ids_only_in_training"] == 0 and ev["target_ids_only_in_checkpoint"] == 0
    assert out["facts"]["coverage"]["outside"] == int((~np.isin(training_tokens(), hot_ids())).sum())


def test_missing_d2t_is_the_existing_vocab_map_missing(tmp_path):
    d = damaged(tmp_path, drop=["d2t"])
    out = inspect_draft(d, REFERENCE_TARGET, REFERENCE_TRAINING)
    assert "vocab_map_missing" in kinds(out["findings"])
    assert out["facts"]["coverage"]["outside"] == int((training_tokens() >= 2048).sum())


def test_d2t_out_of_range_or_of_the_wrong_length_is_bad_input(tmp_path):
    d2t = ref_tensor("d2t").clone()
    d2t[5] = 5000
    with pytest.raises(BadInput, match=r"\[d2t\].*draft id 5 to target id 5005"):
        draft_checks(damaged(tmp_path, replace={"d2t": d2t}, name="a"), REFERENCE_TARGET)
    with pytest.raises(BadInput, match=r"\[d2t\]: 1024 entries but the lm_head has 2048 rows"):
        draft_checks(damaged(tmp_path, replace={"d2t": ref_tensor("d2t")[:1024].clone()}, name="b"))


def test_target_tokens_outside_the_vocab_give_the_ceiling(tmp_path):
    hot = set(hot_ids().tolist())
    inside = [t for t in range(4096) if t in hot][:4]
    out_ids = [t for t in range(4096) if t not in hot][:2]
    # in in OUT in in in OUT OUT in in -> runs from each position: 2 1 0 3 2 1 0 0 2 1
    toks = [inside[0], inside[1], out_ids[0], inside[2], inside[3], inside[0], out_ids[1], out_ids[0],
            inside[1], inside[2]]
    out = inspect_draft(REFERENCE_DRAFT, REFERENCE_TARGET, target_tokens=toks)
    f = one(out["findings"], "draft_vocab_coverage")
    ev = f["evidence"]
    assert ev["tokens"] == 10 and ev["outside"] == 3 and ev["outside_share"] == pytest.approx(0.3)
    assert ev["ceiling_p_accept_ge"] == pytest.approx([0.7, 0.4, 0.1])
    assert ev["ceiling_accept_length"] == pytest.approx(2.2)
    with pytest.raises(BadInput, match=r"\[target_tokens\].*outside the target vocab"):
        draft_checks(REFERENCE_DRAFT, REFERENCE_TARGET, target_tokens=[1, 2, 4096])


# ----------------------------------------------------------------------------------- position encoding

def test_shrunk_max_position_embeddings(tmp_path):
    d = damaged(tmp_path, config=lambda c: c.update(max_position_embeddings=256))
    f = one(draft_checks(d, REFERENCE_TARGET), "max_position_short")
    assert f["evidence"]["draft_context_length"] == 256 and f["evidence"]["target_context_length"] == 512
    assert "ValueError" in f["detail"] and "--context-length 256" in f["evidence"]["fix"]
    # a longer draft context is accepted: a note, no finding
    out = inspect_draft(damaged(tmp_path, config=lambda c: c.update(max_position_embeddings=4096), name="b"),
                        REFERENCE_TARGET)
    assert out["findings"] == [] and "longer than the target's 512" in out["notes"][0]


def test_a_rope_unlike_the_targets_is_a_note_since_sglang_runs_the_drafts_own(tmp_path):
    """SGLang builds the draft's rotary embedding from the draft config alone (llama.py LlamaDecoderLayer.__init__),
    and SpecForge trains it from the same config: a draft rope unlike the target's is what the draft was trained
    with, not a fault; the note says so and names the difference."""
    def in_parameters(c):
        c["rope_parameters"]["rope_theta"] = 20000.0
    out = inspect_draft(damaged(tmp_path, config=in_parameters, name="a"), REFERENCE_TARGET)
    assert out["findings"] == []
    assert out["facts"]["rope"]["differs_from_target"] == {"rope_theta": [20000.0, 10000.0]}
    assert out["facts"]["rope"]["sglang_builds"]["rope_theta"] == 20000.0
    assert any("rope_theta 20000.0 vs 10000.0" in n and "never the target's" in n for n in out["notes"])
    assert any("ignored its rope_theta 20000" in n and "PR #270" in n for n in out["notes"])
    # a top-level rope_theta beside rope_parameters: transformers 5 / SGLang use rope_parameters', a note names both
    out = inspect_draft(damaged(tmp_path, config=lambda c: c.update(rope_theta=20000.0), name="b"), REFERENCE_TARGET)
    assert out["findings"] == [] and out["facts"]["rope"]["sglang_builds"]["rope_theta"] == 10000.0
    assert any("two rope thetas" in n and "20000.0" in n for n in out["notes"])
    # linear scaling: a longer context (512 x 2), no max_position finding, a note
    def scaled(c):
        c["rope_parameters"] = {"rope_theta": 10000.0, "rope_type": "linear", "factor": 2.0}
    out = inspect_draft(damaged(tmp_path, config=scaled, name="c"), REFERENCE_TARGET)
    assert out["findings"] == [] and out["facts"]["context_length"]["draft"] == 1024
    assert out["facts"]["rope"]["differs_from_target"] == {"rope_type": ["linear", "default"], "factor": [2.0, None]}


def test_rope_sglang_changes_is_a_finding(tmp_path):
    """llama.py LlamaDecoderLayer.__init__ (l. 329-334) replaces rope_parameters' original_max_position_embeddings by
    a top-level one: SGLang then serves another yarn than the config (and its trainer) describe."""
    def two_originals(c):
        c["rope_parameters"] = {"rope_theta": 10000.0, "rope_type": "yarn", "factor": 2.0,
                                "original_max_position_embeddings": 256}
        c["original_max_position_embeddings"] = 128
    f = one(draft_checks(damaged(tmp_path, config=two_originals), REFERENCE_TARGET), "rope_mismatch")
    assert f["evidence"]["changes"]["original_max_position_embeddings"]["config"] == 256
    assert f["evidence"]["changes"]["original_max_position_embeddings"]["sglang"] == 128
    assert f["evidence"]["served"]["scaling"]["original_max_position_embeddings"] == 128
    assert "llama.py::LlamaDecoderLayer.__init__" in f["evidence"]["source"]


def test_sliding_window_turned_on_is_ignored_by_sglang(tmp_path):
    f = one(draft_checks(damaged(tmp_path, config=lambda c: c.update(sliding_window=128, use_sliding_window=True),
                                 name="a"), REFERENCE_TARGET), "sliding_window_ignored")
    assert f["evidence"]["draft_sliding_window"] == 128 and f["evidence"]["served_context"] == 512
    assert "--speculative-draft-window-size 128" in f["evidence"]["fix"]
    # a window the config does not turn on (Qwen2-style use_sliding_window false, or no flag: LlamaConfig has none)
    for name, extra in (("b", {"use_sliding_window": False}), ("c", {})):
        out = inspect_draft(damaged(tmp_path, config=lambda c: c.update(sliding_window=128, **extra), name=name),
                            REFERENCE_TARGET)
        assert out["findings"] == [] and any("does not turn it on" in n for n in out["notes"])
    # a window no shorter than the served context changes nothing
    assert draft_checks(damaged(tmp_path, config=lambda c: c.update(sliding_window=512, use_sliding_window=True),
                                name="d"), REFERENCE_TARGET) == []


# --------------------------------------------------------------------------------------- fc / norm flags

def test_norm_before_fc_without_its_weight(tmp_path):
    d = damaged(tmp_path, config=lambda c: c["eagle_config"].update(norm_before_fc=True))
    f = one(draft_checks(d, REFERENCE_TARGET), "draft_weight_missing")
    assert f["evidence"]["missing"] == [{"param": "model.input_norm.weight", "shape": [384],
                                         "init": f["evidence"]["missing"][0]["init"]}]
    assert f["evidence"]["missing"][0]["init"].startswith("ones")
    assert "norm_before_fc is set" in f["evidence"]["hint"]


def test_fc_norm_weights_without_the_flag_are_dropped(tmp_path):
    norms = {f"fc_norm.{i}.weight": torch.ones(128, dtype=torch.bfloat16) * 1.5 for i in range(3)}
    d = damaged(tmp_path, replace=norms, config=lambda c: c["eagle_config"].update(fc_norm=True), name="a")
    fs = draft_checks(d, REFERENCE_TARGET)
    assert kinds(fs) == ["draft_weight_ignored", "draft_flag_ignored"]
    assert fs[0]["evidence"]["tensors"] == sorted(norms) and "top level" in fs[0]["detail"]
    assert fs[1]["evidence"]["flags"][0]["flag"] == "eagle_config.fc_norm"
    # with the flag at the top level they load: clean
    d = damaged(tmp_path, replace=norms, config=lambda c: c.update(fc_norm=True), name="b")
    assert draft_checks(d, REFERENCE_TARGET) == []


def test_norm_before_residual_is_ignored_by_sglang(tmp_path):
    f = one(draft_checks(damaged(tmp_path, config=lambda c: c.update(norm_before_residual=True)), REFERENCE_TARGET),
            "draft_flag_ignored")
    assert f["evidence"]["flags"][0]["flag"] == "norm_before_residual"


def test_wrong_fc_width_is_bad_input_naming_file_and_key(tmp_path):
    d = damaged(tmp_path, config=lambda c: c.update(num_aux_hidden_states=4), name="a")
    with pytest.raises(BadInput) as e:
        draft_checks(d, REFERENCE_TARGET)
    msg = str(e.value)
    assert msg.startswith(f"{d / WEIGHTS} [fc.weight]: shape [128, 384]") and "[128, 512]" in msg
    assert "num_aux_hidden_states" in msg and "\n" not in msg
    d = damaged(tmp_path, replace={"fc.weight": ref_tensor("fc.weight")[:, :256].contiguous()}, name="b")
    with pytest.raises(BadInput, match=r"\[fc.weight\]: shape \[128, 256\].*\[128, 384\]"):
        draft_checks(d)


def test_midlayer_width_not_matching_the_config(tmp_path):
    q = ref_tensor("midlayer.self_attn.q_proj.weight")[:, :128].contiguous()
    d = damaged(tmp_path, replace={"midlayer.self_attn.q_proj.weight": q})
    with pytest.raises(BadInput) as e:
        draft_checks(d)
    msg = str(e.value)
    assert "[midlayer.self_attn.q_proj.weight]" in msg and "[128, 128]" in msg and "[128, 256]" in msg
    assert "shard q of model.layers.0.self_attn.qkv_proj.weight" in msg


def test_target_hidden_size_unlike_the_target_is_a_width_mismatch(tmp_path):
    def cfg(c):
        c["target_hidden_size"] = 96
    fc = torch.zeros(128, 288, dtype=torch.bfloat16)
    f = one(draft_checks(damaged(tmp_path, config=cfg, replace={"fc.weight": fc}), REFERENCE_TARGET), "width_mismatch")
    assert f["evidence"]["served_width"] == 384 and f["evidence"]["fc_in_features"] == 288


# --------------------------------------------------------------------------------------- reading inputs

def test_sharded_checkpoint_through_its_index(tmp_path):
    d = tmp_path / "sharded"
    shutil.copytree(REFERENCE_DRAFT, d)
    t = load_file(d / WEIGHTS)
    (d / WEIGHTS).unlink()
    keys = sorted(t)
    parts = {"model-00001-of-00002.safetensors": keys[: len(keys) // 2],
             "model-00002-of-00002.safetensors": keys[len(keys) // 2:]}
    for name, ks in parts.items():
        save_file({k: t[k] for k in ks}, d / name, metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: name for name, ks in parts.items() for k in ks}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    out = inspect_draft(d, REFERENCE_TARGET, REFERENCE_TRAINING)
    assert out["findings"] == [] and len(out["facts"]["weights"]["files"]) == 2
    # an index naming a shard that is not there
    index["weight_map"]["norm.weight"] = "model-00003-of-00002.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(BadInput, match="model.safetensors.index.json: the index names shard model-00003"):
        draft_checks(d)


def test_unreadable_weights_and_unserved_architectures(tmp_path):
    d = damaged(tmp_path, name="a")
    (d / WEIGHTS).write_bytes(b"not a safetensors file at all")
    with pytest.raises(BadInput, match=rf"{WEIGHTS}: not a readable safetensors file"):
        draft_checks(d)
    d = damaged(tmp_path, config=lambda c: c.update(architectures=["Eagle3DeepseekV2ForCausalLM"],
                                                     num_hidden_layers=2), name="b")
    with pytest.raises(BadInput, match=r"\[num_hidden_layers\].*only supports 1 layer"):
        draft_checks(d)
    fs = draft_checks(damaged(tmp_path, config=lambda c: c.update(architectures=["LlamaForCausalLM"]), name="c"))
    assert kinds(fs) == ["unsupported_draft"]


def test_config_without_num_hidden_layers_gets_llamaconfigs_32_layers(tmp_path):
    d = damaged(tmp_path, config=lambda c: c.pop("num_hidden_layers"))
    out = inspect_draft(d, REFERENCE_TARGET)
    f = one(out["findings"], "draft_weight_missing")
    params = {m["param"] for m in f["evidence"]["missing"]}
    # layers 1..31 (q, k, v, o, gate, up, down, hidden_norm and post_attention_layernorm each) exist in SGLang's
    # draft and nothing fills them; their input_layernorm exists too but the forward never reads it (layers > 0)
    assert len(params) == 31 * 9 and "model.layers.31.mlp.down_proj.weight" in params
    assert "model.layers.31.input_layernorm.weight" not in params
    assert "model.layers.0.mlp.down_proj.weight" not in params
    assert out["facts"]["fc"]["config_defaults"] == {"num_hidden_layers": 32}


def test_lm_head_under_a_name_sglang_does_not_map(tmp_path):
    d = damaged(tmp_path, drop=["lm_head.weight"], replace={"model.lm_head.weight": ref_tensor("lm_head.weight")})
    f = one(draft_checks(d, REFERENCE_TARGET), "lm_head_missing")
    assert f["evidence"]["lm_head_keys"] == ["model.lm_head.weight"] and "model.lm_head.weight is there" in f["detail"]


def test_use_aux_hidden_state_false_is_the_existing_fc_bypassed_and_versions_are_said(tmp_path):
    d = damaged(tmp_path, config=lambda c: c["eagle_config"].update(use_aux_hidden_state=False))
    assert kinds(draft_checks(d, REFERENCE_TARGET)) == ["fc_bypassed"]
    out = inspect_draft(REFERENCE_DRAFT, REFERENCE_TARGET, sglang_version="0.5.30")
    assert out["findings"] == [] and "0.5.23" in out["facts"]["sglang"]["note"]
    with pytest.raises(BadInput, match=r"\[sglang_version\]"):
        draft_checks(REFERENCE_DRAFT, sglang_version="latest")
