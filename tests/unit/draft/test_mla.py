"""The MLA draft (``Eagle3DeepseekV2ForCausalLM``, sglang/srt/models/kimi_k25_eagle3.py) in the offline draft run.

Checked against two independent implementations on real tensors: the trainer's module (env/models/e3f_models/
draft_mla.py: the expanded MLA it was trained with, TTT steps 0-2) and SGLang 0.5.23's own model forward (its
``Eagle3DeepseekV2ForCausalLM`` loaded by its own ``load_weights``, one draft-extend batch through its torch_native
attention backend in the SGLang venv: tests/support/sglang_mla_draft_forward.py, one process for every job), on the
shipped checkpoint and on a copy with DeepSeek-yarn scaling, neox rope and per-chunk fc norms at later positions.
Then the acceptance budget with both Kimi drafts: the teacher-forced metric reproduces each training log on its
validation rows, and ``simulate`` clears the clean MLA checkpoint and names a damaged one."""
from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers.draft import teacher_forced as tf
from helpers.draft.checks import inspect_draft
from helpers.draft.attention import mla_inv_freq
from helpers.draft.model import DraftArch, Eagle3Draft, find_target_tensor, target_lm_head
from helpers.errors import BadInput
from helpers.formats.training_data import TrainingData
from support import ROOT, import_from
from support.drafts import damaged_draft

MODELS = ROOT / "env" / "models"
KIMI = MODELS / "kimi"
MLA, LLAMA_STYLE, TARGET = KIMI / "draft_mla", KIMI / "draft", KIMI / "target"
SAMPLE, VALIDATION = KIMI / "data" / "sample", KIMI / "data" / "validation"
SGLANG_PY = ROOT / "env" / "reference" / ".venv" / "bin" / "python"


def _sample(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    d = torch.load(SAMPLE / "rows_0-2000" / f"data_{i}.ckpt", weights_only=True)
    ids = d["input_ids"].reshape(-1)
    return ids, d["aux_hidden_state"].reshape(ids.shape[0], -1).float()


@pytest.fixture(scope="module")
def draft():
    return Eagle3Draft.load(MLA, TARGET, dtype=torch.float32)


def test_mla_draft_reads_kimi_k25_eagle3s_construction(draft, tmp_path):
    """The shapes and rope SGLang builds from the config (params mirror + MLAShape), and the yarn frequencies /
    softmax scale against the trainer's own implementation at Kimi-K2.5's real rope (TorchSpec's public MLA draft
    config: yarn factor 64, legacy rope_scaling with a top-level rope_theta)."""
    a = draft.arch
    assert a.architecture == "Eagle3DeepseekV2ForCausalLM" and a.layers == 1 and not a.norm_before_fc
    m = a.mla
    assert (m.q_lora, m.kv_lora, m.nope, m.rope, m.v, m.interleave) == (64, 64, 16, 8, 16, True)
    assert m.scaling == pytest.approx((16 + 8) ** -0.5)             # factor 1: no mscale
    assert draft.sources["embed"] == "target model.safetensors:model.embed_tokens.weight"
    assert draft.attn.w_kc.shape == (8, 16, 64) and draft.attn.w_vc.shape == (8, 64, 16)
    import_from(MODELS, "e3f_models")
    from e3f_models.draft_mla import mla_softmax_scale, yarn_inv_freq
    shutil.copy(ROOT / "tests" / "data" / "public_configs" / "torchspec" / "kimi_k25_eagle3_mla.json",
                tmp_path / "config.json")
    kimi = DraftArch.from_config(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    rope = {**cfg["rope_scaling"], "rope_type": "yarn", "rope_theta": cfg["rope_theta"]}
    ours, mscale = mla_inv_freq(kimi.mla, kimi.rope_theta)
    want, want_mscale = yarn_inv_freq(rope, 64, 4096)
    assert (kimi.heads, kimi.mla.kv_lora, kimi.mla.rope, kimi.draft_vocab) == (64, 512, 64, 163840)
    assert torch.allclose(ours, want, rtol=1e-6) and mscale == pytest.approx(want_mscale)
    assert kimi.mla.scaling == pytest.approx(mla_softmax_scale({**cfg, "rope_parameters": rope}))
    assert kimi.mla.scaling == pytest.approx(192 ** -0.5 * (0.1 * math.log(64) + 1) ** 2)


def test_extend_and_steps_equal_the_trainers_module(draft):
    """Step 0 (draft-extend), step 1 and step 2 (own hidden, each row attending to the step-0 rows up to it, its own
    earlier steps' latents and itself) equal the trainer's TTT unroll (expanded MLA) on a shipped sample."""
    import_from(MODELS, "e3f_models")
    ref = import_from(MODELS, "eval_draft_faults").load_draft(MLA, TARGET)[0].float()
    ids, aux = _sample(0)
    T = ids.shape[0] - 1
    ext = draft.extend(ids[1:], aux[:T])
    causal = torch.full((T, T), float("-inf")).triu(1)
    cache: list = []
    with torch.no_grad():
        h0 = ref.midlayer(ref.embed(ids[1:][None]), ref.aux_to_hidden(aux[:T][None]), cache, torch.arange(T), causal)
        lg0 = ref.lm_head(ref.norm(h0)).float()[0]
        n, m = T - 1, T - 2
        c1 = [(k[:, :, :n], v[:, :, :n]) for k, v in cache]
        h1 = ref.midlayer(ref.embed(ids[2:][None]), h0[:, :n], c1, torch.arange(n) + 1, causal[:n, :n])
        lg1 = ref.lm_head(ref.norm(h1)).float()[0]
        c2 = [(k[:, :, :m], v[:, :, :m]) for k, v in c1]
        h2 = ref.midlayer(ref.embed(ids[3:][None]), h1[:, :m], c2, torch.arange(m) + 2, causal[:m, :m])
        lg2 = ref.lm_head(ref.norm(h2)).float()[0]
    r = torch.arange(n)
    hid1, out1, kv1 = draft.step(ids[r + 2], ext.hidden[:n], r + 1, r + 1, ext, [])
    r = torch.arange(m)
    _, out2, _ = draft.step(ids[r + 3], hid1[:m], r + 2, r + 1, ext, [[(a[:m], b[:m]) for a, b in kv1]])
    diffs = [(ext.logits - lg0).abs().max().item(), (out1 - lg1).abs().max().item(), (out2 - lg2).abs().max().item()]
    assert max(diffs) < 1e-4, diffs                                   # measured 6.7e-6, 8.1e-6, 7.2e-6
    assert (ext.hidden - h0[0]).abs().max() < 1e-4
    for ours, ref_lg in ((ext.logits, lg0), (out1, lg1), (out2, lg2)):
        assert (ours.argmax(-1) == ref_lg.argmax(-1)).all()


def _variant(tmp_path, interleave: bool = True):
    """A copy of the MLA draft SGLang builds differently: DeepSeek-yarn at factor 4 over 128 original positions
    (interpolated frequencies, cos/sin and softmax mscale), per-chunk fc norms, neox rope when not ``interleave``
    (SGLang's CPU path cannot run that one: ``DeepseekScalingRotaryEmbedding.forward_native`` broadcasts its neox
    cos/sin to 4 dimensions and ``forward_absorb_core`` fails to concatenate; GPU servers take ``forward_cuda``)."""
    out = tmp_path / f"mla-variant{'' if interleave else '-neox'}"
    shutil.copytree(MLA, out)
    cfg = json.loads((out / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 4.0,
                              "original_max_position_embeddings": 128, "beta_fast": 32.0, "beta_slow": 1.0,
                              "mscale": 1.0, "mscale_all_dim": 1.0}
    cfg["rope_interleave"] = interleave
    cfg["fc_norm"] = True
    (out / "config.json").write_text(json.dumps(cfg))
    w = load_file(out / "model.safetensors")
    g = torch.Generator().manual_seed(0)
    for i in range(3):
        w[f"fc_norm.{i}.weight"] = (1 + 0.3 * torch.randn(128, generator=g)).to(torch.bfloat16)
    save_file(w, out / "model.safetensors")
    return out


@pytest.fixture(scope="module")
def sglang_runs(tmp_path_factory):
    """SGLang's own forward on three jobs in one SGLang-venv process: the shipped draft on sample 0 (float32 and
    bfloat16), the variant on sample 1 at positions 300 onwards (float32)."""
    if not SGLANG_PY.exists():
        pytest.skip("env/reference/.venv (sglang 0.5.23) not installed")
    tmp = tmp_path_factory.mktemp("sglang-mla")
    variant = _variant(tmp)
    jobs, runs = [], []
    for name, folder, sample, start, dtype in (("shipped", MLA, 0, 0, "float32"), ("shipped", MLA, 0, 0, "bfloat16"),
                                                ("variant", variant, 1, 300, "float32")):
        ids, aux = _sample(sample)
        T = min(ids.shape[0] - 1, 96)
        x = {"input_ids": ids[1:T + 1], "aux": aux[:T], "positions": torch.arange(start, start + T)}
        torch.save(x, tmp / f"in-{len(jobs)}.pt")
        jobs.append([str(folder), str(TARGET), str(tmp / f"in-{len(jobs)}.pt"), str(tmp / f"out-{len(jobs)}.pt"),
                     dtype])
        runs.append((name, folder, dtype, x))
    (tmp / "jobs.json").write_text(json.dumps(jobs))
    env = {**os.environ, "SGLANG_USE_CPU_ENGINE": "1", "TORCHDYNAMO_DISABLE": "1", "E3F_LOOPBACK_STORE": "1",
           "PYTHONPATH": str(ROOT / "env" / "reference" / "standin")}
    res = subprocess.run([str(SGLANG_PY), str(ROOT / "tests" / "support" / "sglang_mla_draft_forward.py"),
                          str(tmp / "jobs.json")], cwd=ROOT / "tests" / "support", capture_output=True, text=True,
                         env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return [(*r, torch.load(j[3], weights_only=True)) for r, j in zip(runs, jobs)]


def test_logits_equal_sglangs_own_eagle3deepseekv2_forward(sglang_runs):
    """The draft-extend pass equals SGLang's own model forward (weight-absorbed MLA, as its dispatch picks for a
    draft-extend batch) on every row, for the shipped draft and the variant (yarn factor 4, fc norms, positions
    300+): float32 to 1e-4 (measured 0.0), bfloat16 to two bf16 steps at the logits'
    magnitude with the same argmax."""
    for name, folder, dtype, x, out in sglang_runs:
        assert out["attention"] == ["MLA"], out["attention"]
        d = Eagle3Draft.load(folder, TARGET, dtype=getattr(torch, dtype))
        ext = d.extend(x["input_ids"], x["aux"], x["positions"])
        diff = (ext.logits - out["logits"]).abs().max().item()
        hdiff = (ext.hidden.float() - out["hidden"]).abs().max().item()
        if dtype == "float32":
            assert diff < 1e-4 and hdiff < 1e-4, (name, diff, hdiff)
        else:
            assert diff <= 0.125 and hdiff <= 0.05, (name, diff, hdiff)     # measured 0.0625 (one step at 8-16)
        assert (ext.logits.argmax(-1) == out["logits"].argmax(-1)).float().mean() == 1.0, name
    # the variant is a different model: its rope / scale / fc norms change the logits
    shipped, variant = sglang_runs[0][4]["logits"], sglang_runs[2][4]["logits"]
    assert (shipped[:10] - variant[:10]).abs().max() > 1.0


def test_neox_rope_of_an_mla_draft_equals_transformers(tmp_path):
    """rope_interleave false: neox halves (rope_variant.py ``rotate_neox``), checked against transformers'
    DeepSeek-V3 ``apply_rotary_pos_emb`` with the same yarn frequencies and multiplier."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import apply_rotary_pos_emb
    d = Eagle3Draft.load(_variant(tmp_path, interleave=False), TARGET, dtype=torch.float32)
    assert d.arch.mla.interleave is False and d.arch.mla.yarn["factor"] == 4.0
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(50, 8, 8, generator=g), torch.randn(50, 1, 8, generator=g)
    pos = torch.arange(300, 350)
    inv, mscale = mla_inv_freq(d.arch.mla, d.arch.rope_theta)
    ang = pos.float()[:, None] * inv[None]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1) * mscale, torch.cat([ang.sin(), ang.sin()], -1) * mscale
    want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)
    assert torch.allclose(d.attn._rope(q, pos), want_q, atol=1e-6)
    assert torch.allclose(d.attn._rope(k, pos), want_k, atol=1e-6)
    assert not torch.allclose(Eagle3Draft.load(_variant(tmp_path), TARGET).attn._rope(q, pos), want_q, atol=1e-3)


def _copy(tmp_path, name, **edit):
    out = tmp_path / name
    shutil.copytree(MLA, out)
    w = load_file(out / "model.safetensors")
    for k, v in edit.items():
        k = k.replace("__", ".")
        if v is None:
            del w[k]
        else:
            w[k] = v
    save_file(w, out / "model.safetensors")
    return out


def test_mla_checkpoint_unlike_its_config_is_one_line_naming_file_and_key(tmp_path):
    bad = _copy(tmp_path, "shape", layers__0__self_attn__kv_b_proj__weight=torch.zeros(256, 32, dtype=torch.bfloat16))
    with pytest.raises(BadInput, match=r"model\.safetensors.*layers\.0\.self_attn\.kv_b_proj\.weight.*\[256, 64\]"
                                       r".*kv_lora_rank") as e:
        Eagle3Draft.load(bad, TARGET)
    assert "\n" not in str(e.value)
    gone = _copy(tmp_path, "missing", layers__0__self_attn__q_a_layernorm__weight=None)
    with pytest.raises(BadInput, match=r"layers\.0\.self_attn\.q_a_layernorm\.weight.*Eagle3DeepseekV2ForCausalLM"):
        Eagle3Draft.load(gone, TARGET)
    half = _copy(tmp_path, "half", layers__0__self_attn__kv_a_proj_with_mqa__weight=None)
    f = [x for x in inspect_draft(half, TARGET)["findings"] if x["kind"] == "draft_weight_missing"]
    assert len(f) == 1 and f[0]["evidence"]["missing"][0]["param"].endswith("fused_qkv_a_proj_with_mqa.weight[kv_a]")
    assert "neither is loaded" in f[0]["evidence"]["hint"]
    assert inspect_draft(MLA, TARGET)["findings"] == []              # every decoder-layer tensor resolved and used


def test_the_target_embedding_and_lm_head_of_a_deepseek_checkpoint(tmp_path):
    """DeepSeek-V3 / Kimi-K2 checkpoints carry an MTP layer with its own embed_tokens beside the model's
    (model.layers.61.embed_tokens.weight); the model's is the one SGLang shares with the draft."""
    t = tmp_path / "ds"
    t.mkdir()
    (t / "config.json").write_text(json.dumps({"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
                                               "hidden_size": 8, "vocab_size": 16, "num_hidden_layers": 61,
                                               "tie_word_embeddings": False}))
    save_file({"model.layers.61.embed_tokens.weight": torch.zeros(16, 8),
               "model.embed_tokens.weight": torch.ones(16, 8),
               "model.layers.61.shared_head.head.weight": torch.zeros(16, 8),
               "lm_head.weight": torch.full((16, 8), 2.0), "model.norm.weight": torch.ones(8)}, t / "model.safetensors")
    assert find_target_tensor(t, "embed_tokens.weight")[0] == "model.embed_tokens.weight"
    head, src = target_lm_head(t)
    assert src.endswith(":lm_head.weight") and float(head[0, 0]) == 2.0
    assert find_target_tensor(TARGET, "embed_tokens.weight")[0] == "model.embed_tokens.weight"


@pytest.fixture(scope="module")
def validation_seqs():
    return tf.tf_sequences(TrainingData(VALIDATION, hidden_size=128), target_lm_head(TARGET)[0])


@pytest.mark.parametrize("folder", [MLA, LLAMA_STYLE], ids=["mla", "llama_style"])
def test_teacher_forced_metric_reproduces_each_kimi_training_log(folder, validation_seqs):
    """The e3f metric of the checkpoint on the 48 shipped validation rows (float32): the log's val_final lies inside
    the CI at every TTT step, and the figure is the trainer's own on these rows (export_validation.py's record,
    per-batch averaged on the GPU) to within a point."""
    d = Eagle3Draft.load(folder, TARGET, dtype=torch.float32)
    res = tf.reduce(tf.run(d, validation_seqs, 4), "e3f", 4)
    log = json.loads((folder / "training_log.json").read_text())["val_final"]["acc_per_step"]
    rec = json.loads((VALIDATION / "capture.json").read_text())[f"eval_{folder.name}"]["first_48"]["acc_per_step"]
    assert res.sequences == 48 and res.rows == 4560
    for k in range(4):
        lo, hi = res.acc_ci[k]
        assert lo <= log[k] <= hi, (k, res.acc[k], res.acc_ci[k], log[k])
        assert abs(res.acc[k] - rec[k]) < 0.01, (k, res.acc[k], rec[k])
    assert res.acc[0] > res.acc[3]


def _simulate(*args):
    return subprocess.run([sys.executable, "-m", "helpers", "simulate", "--target", str(TARGET), "--training",
                           str(SAMPLE), "--dtype", "float32", "--json", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)


def test_simulate_budget_with_the_mla_draft(tmp_path):
    """``python -m helpers simulate`` on the MLA draft finds the validation rows beside the training samples; the
    draft stage clears the clean checkpoint and counts for a copy damaged in fc, attention and MLP."""
    out = _simulate("--draft", MLA)
    assert out.returncode == 0, out.stderr[-2000:]
    doc = json.loads(out.stdout)
    st = {s["name"]: s for s in doc["stages"]}
    ds = st["checkpoint (teacher-forced)"]
    assert ds["rows"]["path"] == str(VALIDATION) and ds["comparable"] and ds["rows"]["sequences"] == 48
    assert doc["losses"]["draft"]["decision"] == "clear" and doc["cause"] == "none", doc["sentence"]
    assert "Eagle3DeepseekV2ForCausalLM" in out.stderr and doc["draft_findings"] == []
    bad = damaged_draft(tmp_path / "damaged", src=MLA, noise=2.0,
                        tensors=("fc.weight", "layers.0.self_attn.q_a_proj.weight",
                                 "layers.0.self_attn.kv_b_proj.weight", "layers.0.mlp.gate_proj.weight"))
    out = _simulate("--draft", bad)
    assert out.returncode == 1, out.stderr[-2000:]
    doc = json.loads(out.stdout)
    assert doc["cause"] == "draft" and doc["losses"]["draft"]["decision"] == "counts", doc["sentence"]
    table = next(s for s in doc["stages"] if s["name"] == "checkpoint (teacher-forced)")["table"]
    assert all(r["acc_ci"][1] < r["log_acc"] - 0.1 for r in table), table


@pytest.mark.parametrize("edit, field", [
    ({"rope_parameters": ["yarn", 1.0]}, "rope_parameters"),
    ({"rope_parameters": "__factor__-4"}, r"rope_parameters\.factor"),
    ({"rope_parameters": "__original_max_position_embeddings__0"}, r"rope_parameters\.original_max_position_embeddings"),
])
def test_an_mla_rope_sglang_cannot_build_is_one_line_naming_the_field(tmp_path, edit, field):
    """A rope block that is not an object, or a DeepSeek-yarn factor / original length that is not positive (yarn
    divides by both), is refused naming the field; before, it ran with default rope or negative frequencies."""
    out = tmp_path / "d"
    shutil.copytree(MLA, out)
    cfg = json.loads((out / "config.json").read_text())
    v = edit["rope_parameters"]
    if isinstance(v, str):
        key, val = v.strip("_").rsplit("__", 1)
        cfg["rope_parameters"] = {**cfg["rope_parameters"], key: float(val)}
    else:
        cfg["rope_parameters"] = v
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(BadInput, match=rf"config\.json \[{field}\]") as e:
        Eagle3Draft.load(out, TARGET)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("folder", ["draft_mla", "draft"])
def test_extend_many_is_extend_per_set(folder, draft):
    """The draft-extend pass of one token sequence under 3 sets of aux states at once (the chunks of a training
    sample in three orders, as plan identification stacks candidate plans) gives, bit for bit, each set's own
    :meth:`Eagle3Draft.extend`: logits, carried hidden state and KV cache entries (MLA and Llama-style draft)."""
    d = draft if folder == "draft_mla" else Eagle3Draft.load(KIMI / folder, TARGET, dtype=torch.float32)
    ids, aux = _sample(0)
    H = aux.shape[1] // 3
    sets = torch.stack([aux] + [torch.cat([aux[:, i * H:(i + 1) * H] for i in order], dim=-1)
                                for order in ([2, 1, 0], [1, 0, 2])])
    many = d.extend_many(ids[1:], sets[:, :-1])
    for b, got in enumerate(many):
        one = d.extend(ids[1:], sets[b, :-1])
        assert torch.equal(got.logits, one.logits) and torch.equal(got.hidden, one.hidden), b
        assert all(torch.equal(x, y) for e, f in zip(got.kv, one.kv) for x, y in zip(e, f)), b
    # the sets are told apart (each attends to its own rows only): another chunk order, other logits
    assert not torch.allclose(many[0].logits, many[1].logits)
    with pytest.raises(BadInput, match=r"expected \[sets, "):
        d.extend_many(ids[1:], sets[:, :-2])
