"""Inputs an adversarial user gives ``python -m helpers simulate`` / the acceptance budget, built from the reference
draft, target and training sample with one edit each: every one gives correct figures or ONE line
``simulate: error: <file or field>: <what was expected>`` with exit 2 (never a bare exception, exit 1)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers.cli.simulate import cli_main
from helpers.draft.budget import dump_sequences, training_sequences
from helpers.draft.checks import draft_checks
from helpers.draft.model import Eagle3Draft, find_target_tensor
from helpers.errors import BadInput
from helpers.formats.dumps import write_dump
from helpers.formats.training_data import TrainingData
from helpers.paths import REFERENCE_DRAFT, REFERENCE_TARGET, REFERENCE_TRAINING
from support import ROOT


def _draft(tmp_path, name, *, cfg=None, edit=None):
    """A copy of the reference draft with ``cfg`` merged into its config and ``edit(tensors)`` applied."""
    d = tmp_path / name
    d.mkdir()
    c = json.loads((REFERENCE_DRAFT / "config.json").read_text())
    c.update(cfg or {})
    (d / "config.json").write_text(json.dumps(c))
    w = load_file(str(REFERENCE_DRAFT / "model.safetensors"))
    if edit:
        edit(w)
    save_file(w, str(d / "model.safetensors"))
    return d


def _training(tmp_path, name, edits):
    """A copy of the reference training sample; ``edits[i](sample dict)`` rewrites sample i (None drops it)."""
    d = tmp_path / name
    shutil.copytree(REFERENCE_TRAINING, d)
    for i, fn in edits.items():
        f = d / "rows_0-2000" / f"data_{i}.ckpt"
        x = None if fn is None else fn(torch.load(f, weights_only=True))
        if x is None:
            f.unlink()
        else:
            torch.save(x, f)
    return d


def _short(x):
    return {k: (v[:2] if v.ndim == 1 else v[:, :2]) for k, v in x.items()}


def _cli(capsys, *args):
    rc = cli_main(["--draft", str(REFERENCE_DRAFT), "--target", str(REFERENCE_TARGET), "--training",
                   str(REFERENCE_TRAINING), *args])
    return rc, capsys.readouterr().err.strip().splitlines()


@pytest.mark.parametrize("device", ["banana", "cuda:99"])
def test_a_device_this_machine_lacks_is_bad_input(capsys, device):
    rc, err = _cli(capsys, "--device", device, "--samples", "1")
    assert rc == 2, err
    assert len(err) == 1 and err[0].startswith("simulate: error: [--device]: "), err


@pytest.mark.parametrize("rope", [{"rope_theta": 1e4, "rope_type": "llama3"},
                                  {"rope_theta": 1e4, "type": "linear"}])
def test_rope_scaling_without_its_factors_takes_sglangs_defaults(tmp_path, rope):
    """rotary_embedding/factory.py::_get_rope_param defaults a missing factor to 1 (llama3: low 1, high 4, original
    max position = max_position_embeddings): the rotary embedding is then the unscaled one."""
    d = _draft(tmp_path, "rope", cfg={"rope_parameters": rope})
    plain = Eagle3Draft.load(REFERENCE_DRAFT, REFERENCE_TARGET)
    scaled = Eagle3Draft.load(d, REFERENCE_TARGET)
    assert torch.allclose(scaled.attn._inv, plain.attn._inv, rtol=1e-6) and scaled.attn._pos_scale == 1.0
    x = torch.randn(4, plain.arch.heads, plain.arch.head_dim)
    assert torch.allclose(scaled.attn._rope(x, torch.arange(4) * 100), plain.attn._rope(x, torch.arange(4) * 100))


@pytest.mark.parametrize("rope", ["linear", {"rope_theta": 1e4, "factor": 2.0}])
def test_rope_scaling_sglang_cannot_read_is_refused_in_one_line(tmp_path, rope):
    d = _draft(tmp_path, "rope", cfg={"rope_parameters": rope})
    with pytest.raises(BadInput) as e:
        Eagle3Draft.load(d, REFERENCE_TARGET)
    assert str(e.value).startswith(f"{d / 'config.json'} [rope_scaling]: ")


def test_a_target_index_naming_a_missing_shard_says_so(tmp_path):
    t = tmp_path / "t"
    t.mkdir()
    shutil.copy(REFERENCE_TARGET / "config.json", t)
    (t / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors"}}))
    with pytest.raises(BadInput, match="model-00001-of-00002.safetensors"):
        find_target_tensor(t, "embed_tokens.weight")


@pytest.mark.parametrize("tensor", ["fc.weight", "norm.weight", "midlayer.self_attn.q_proj.weight"])
def test_a_non_finite_draft_weight_is_named(tmp_path, tensor):
    def poison(w):
        t = w[tensor].clone()
        t.view(-1)[3] = float("nan")
        t.view(-1)[5] = float("inf")
        w[tensor] = t
    d = _draft(tmp_path, "nan", edit=poison)
    with pytest.raises(BadInput) as e:
        Eagle3Draft.load(d, REFERENCE_TARGET)
    assert f"[{tensor}]" in str(e.value) and "1 NaN, 1 Inf" in str(e.value)


def test_non_finite_training_states_name_the_file(tmp_path):
    def poison(x):
        a = x["aux_hidden_state"].clone()
        a[0, 5, 7] = float("nan")
        return {**x, "aux_hidden_state": a}
    d = _training(tmp_path, "tr", {1: poison})
    with pytest.raises(BadInput) as e:
        training_sequences(TrainingData(d, hidden_size=128))
    assert "data_1.ckpt [aux_hidden_state]" in str(e.value)


def test_unusable_samples_are_skipped_and_named(tmp_path):
    """A sample shorter than 3 tokens or with an all-zero loss_mask has no continuation to draft on: it is skipped
    (its file named), the others are simulated; when none is left, one line names the first file."""
    d = _training(tmp_path, "tr", {0: _short, 2: lambda x: {**x, "loss_mask": torch.zeros_like(x["loss_mask"])}})
    skipped: list = []
    seqs = training_sequences(TrainingData(d, hidden_size=128), skipped=skipped)
    n = len(list((REFERENCE_TRAINING / "rows_0-2000").glob("data_*.ckpt")))
    assert [s.key for s in seqs] == ["data_1"] + [f"data_{i}" for i in range(3, n)]
    assert sorted(p.rsplit("/", 1)[-1] for p, _ in skipped) == ["data_0.ckpt", "data_2.ckpt"]
    why = {p.rsplit("/", 1)[-1]: w for p, w in skipped}
    assert why == {"data_0.ckpt": "2 token(s), expected at least 3", "data_2.ckpt": "loss_mask is all zero"}
    only_bad = _training(tmp_path, "bad", {0: _short, 1: None, **{i: None for i in range(2, n)}})
    with pytest.raises(BadInput) as e:
        training_sequences(TrainingData(only_bad, hidden_size=128))
    assert "data_0.ckpt [input_ids]: " in str(e.value) and "2 token(s), expected at least 3" in str(e.value)


def _served(tmp_path, ids):
    """A served dump of the training tokens (rows = the training aux states) with sample ids ``ids``."""
    td = TrainingData(REFERENCE_TRAINING, hidden_size=128)
    samples = [{"key": f"s{i}", "sample_id": sid, "hidden": s.load().float(),
                "input_ids": torch.as_tensor(s.input_ids)} for i, (s, sid) in enumerate(zip(td, ids))]
    return write_dump(tmp_path / "served", samples, {"hidden_size": 128})


def test_served_sample_ids_unlike_the_training_are_bad_input(tmp_path):
    train = training_sequences(TrainingData(REFERENCE_TRAINING, hidden_size=128))
    starts = {s.key: s.start for s in train}
    dump = _served(tmp_path, ["other_0", "other_1", "other_2"])
    with pytest.raises(BadInput) as e:
        dump_sequences(dump, starts=starts)
    assert "[sample_id]" in str(e.value) and "other_0" in str(e.value) and "data_0" in str(e.value)
    shutil.rmtree(dump)
    part = dump_sequences(_served(tmp_path, ["data_0", "zz", "data_2"]), starts=starts)
    assert [s.key for s in part] == ["data_0", "data_2"]
    assert [s.start for s in part] == [starts["data_0"], starts["data_2"]]


def test_the_draft_config_is_checked_before_a_found_training_log(tmp_path, capsys):
    """--draft pointed at the target folder: the line is about the draft's architecture, not about the target's own
    training_log.json that happens to lie there."""
    rc = cli_main(["--draft", str(REFERENCE_TARGET), "--target", str(REFERENCE_TARGET), "--training",
                   str(REFERENCE_TRAINING)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "[architectures]" in err[0], err


SGLANG_PY = ROOT / "env" / "reference" / ".venv" / "bin" / "python"


def _two_layer_llama3(w):
    """A second decoder layer (H-wide qkv, SGLang's layers > 0) made from layer 0 with noise."""
    g = torch.Generator().manual_seed(0)
    for k in [k for k in w if k.startswith("midlayer.")]:
        v = w[k][:, :128] if any(p in k for p in ("q_proj", "k_proj", "v_proj")) else w[k]
        w[k.replace("midlayer.", "layers.1.")] = (v.float() + 0.02 * torch.randn(v.shape, generator=g)).to(v.dtype)


def _both_norms(w):
    """input_norm (norm_before_fc) and legacy per-chunk aux_norm_low/mid/high (use_aux_norm), none of them ones."""
    g = torch.Generator().manual_seed(1)
    w["input_norm.weight"] = (1 + 0.3 * torch.randn(384, generator=g)).to(torch.bfloat16)
    for n in ("low", "mid", "high"):
        w[f"aux_norm_{n}.weight"] = (1 + 0.3 * torch.randn(128, generator=g)).to(torch.bfloat16)


@pytest.mark.skipif(not SGLANG_PY.exists(), reason="env/reference/.venv (sglang 0.5.23) not installed")
def test_the_offline_forward_equals_sglangs_modules(tmp_path):
    """model.py's extend pass against SGLang's own RMSNorm (fused residual add), get_rope and SiluAndMul run in the
    reference venv along llama_eagle3.py's LlamaModel.forward / LlamaDecoderLayer.forward: a 2-layer draft with
    llama3 rope, and input_norm + legacy aux norms. bfloat16 is bit-exact (it was not while model.py normalised the
    rounded residual sum), float32 to 1e-5."""
    drafts = {"two": _draft(tmp_path, "two", edit=_two_layer_llama3, cfg={
                  "num_hidden_layers": 2, "rope_parameters": {"rope_theta": 1e4, "rope_type": "llama3", "factor": 8.0,
                                                              "original_max_position_embeddings": 32}}),
              "norms": _draft(tmp_path, "norms", edit=_both_norms, cfg={
                  "use_aux_norm": True, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 4],
                                                         "norm_before_fc": True}})}
    s = next(iter(TrainingData(REFERENCE_TRAINING, hidden_size=128)))
    ids, aux = torch.as_tensor(s.input_ids)[:48], s.load()[:48].float()
    jobs, ours = [], {}
    for name, d in drafts.items():
        for dt in ("float32", "bfloat16"):
            m = Eagle3Draft.load(d, REFERENCE_TARGET, dtype=getattr(torch, dt))
            assert m.arch.layers == (2 if name == "two" else 1)
            ours[name, dt] = m.extend(ids, aux)
            torch.save({"embeds": m.embed[ids].float(), "aux": aux, "positions": torch.arange(48)},
                       tmp_path / f"{name}-{dt}.in.pt")
            jobs.append([str(d), str(tmp_path / f"{name}-{dt}.in.pt"), str(tmp_path / f"{name}-{dt}.out.pt"), dt])
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    subprocess.run([str(SGLANG_PY), str(ROOT / "tests" / "support" / "sglang_eagle3_forward.py"),
                    str(tmp_path / "jobs.json")], check=True, capture_output=True, timeout=300,
                   env={**os.environ, "SGLANG_USE_CPU_ENGINE": "1"})
    for (name, dt), e in ours.items():
        ref = torch.load(tmp_path / f"{name}-{dt}.out.pt", weights_only=True)
        if dt == "bfloat16":
            assert torch.equal(e.logits, ref["logits"]) and torch.equal(e.hidden, ref["hidden"]), (
                name, (e.logits - ref["logits"]).abs().max())
        else:
            assert torch.allclose(e.logits, ref["logits"], atol=1e-5), (name, (e.logits - ref["logits"]).abs().max())
            assert torch.allclose(e.hidden, ref["hidden"], atol=1e-5)


def test_a_second_layer_without_input_layernorm_is_what_sglang_serves(tmp_path):
    """SGLang builds layers.1.input_layernorm but LlamaDecoderLayer.forward never reads it for layers > 0 (l. 103-105:
    hidden_norm with the fused residual): a checkpoint without it loads, runs as the one with it, and is no
    draft_weight_missing finding."""
    full = _draft(tmp_path, "full", edit=_two_layer_llama3, cfg={"num_hidden_layers": 2})

    def drop(w):
        _two_layer_llama3(w)
        w["layers.1.input_layernorm.weight"] = torch.full((128,), 7.0, dtype=torch.bfloat16)
    odd = _draft(tmp_path, "odd", edit=drop, cfg={"num_hidden_layers": 2})
    w = load_file(str(odd / "model.safetensors"))
    del w["layers.1.input_layernorm.weight"]
    save_file(w, str(odd / "model.safetensors"))
    s = next(iter(TrainingData(REFERENCE_TRAINING, hidden_size=128)))
    ids, aux = torch.as_tensor(s.input_ids)[:32], s.load()[:32]
    a = Eagle3Draft.load(full, REFERENCE_TARGET).extend(ids, aux)
    b = Eagle3Draft.load(odd, REFERENCE_TARGET).extend(ids, aux)
    assert torch.equal(a.logits, b.logits)
    assert not [f for f in draft_checks(odd, REFERENCE_TARGET) if f["kind"] == "draft_weight_missing"]


def test_a_tied_draft_with_a_smaller_draft_vocab_gets_sliced_logits(tmp_path):
    """tie_word_embeddings with draft_vocab_size < vocab_size: lm_head is the (target's) embedding, and SGLang's
    LogitsProcessor, built with vocab_size = draft_vocab_size, keeps the first draft_vocab_size logits
    (logits_processor.py::LogitsProcessor._copy_logits_to_buffer), so every draft id has a d2t entry."""
    d = _draft(tmp_path, "tie", cfg={"tie_word_embeddings": True})
    m = Eagle3Draft.load(d, REFERENCE_TARGET)
    s = next(iter(TrainingData(REFERENCE_TRAINING, hidden_size=128)))
    e = m.extend(torch.as_tensor(s.input_ids)[:16], s.load()[:16])
    assert e.logits.shape == (16, 2048)
    emb = load_file(str(REFERENCE_TARGET / "model.safetensors"))["model.embed_tokens.weight"].float()
    assert torch.equal(m.lm_head, emb[:2048])
    ids = e.logits.argmax(-1)
    assert torch.equal(m.to_target_ids(ids), ids + load_file(str(REFERENCE_DRAFT / "model.safetensors"))["d2t"][ids])


def test_a_broken_jsonl_training_log_names_the_line_of_the_file(tmp_path):
    from helpers.draft.training_log import read_training_log
    f = tmp_path / "log.jsonl"
    f.write_text('{"eval/acc_0": 0.8}\n\n{"eval/acc_0": 0.7, "eval/acc_1": 0.5}\n{broken\n')
    with pytest.raises(BadInput, match=r"log.jsonl: not valid JSONL \(line 4: "):
        read_training_log(f)


def test_more_draft_tokens_than_the_tree_holds_says_the_most_allowed(capsys):
    rc, err = _cli(capsys, "--topk", "4", "--draft-tokens", "64")
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith("simulate: error: [--draft-tokens]: 64 draft tokens") and err[0].endswith("<= 37"), err
    rc, err = _cli(capsys, "--topk", "4", "--draft-tokens", "37", "--samples", "1")
    assert rc in (0, 1) and not any("error" in e for e in err), err     # accepted: exit 2 only for bad input


def test_aux_states_as_wide_as_the_embedding_skip_fc_as_sglang_does(tmp_path):
    """llama_eagle3.py::LlamaModel.forward l. 238: input_norm / fc_norm / fc apply only when the fed hidden state is
    wider than the embedding; one aux chunk of hidden_size (num_aux_hidden_states 1) goes into the layer as is."""
    def one_chunk(seed):
        def edit(w):
            w["fc.weight"] = torch.randn(128, 128, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
        return edit
    a = Eagle3Draft.load(_draft(tmp_path, "a", edit=one_chunk(0), cfg={"num_aux_hidden_states": 1}), REFERENCE_TARGET)
    b = Eagle3Draft.load(_draft(tmp_path, "b", edit=one_chunk(1), cfg={"num_aux_hidden_states": 1}), REFERENCE_TARGET)
    s = next(iter(TrainingData(REFERENCE_TRAINING, hidden_size=128)))
    ids, aux = torch.as_tensor(s.input_ids)[:16], s.load()[:16, 256:].float()
    ea, eb = a.extend(ids, aux), b.extend(ids, aux)
    assert torch.equal(ea.logits, eb.logits)
    ref = Eagle3Draft.load(REFERENCE_DRAFT, REFERENCE_TARGET)
    assert not torch.equal(ea.logits, ref.extend(ids, torch.cat([aux] * 3, -1)).logits)


def test_the_offline_run_takes_the_rope_theta_the_config_checks_say_sglang_uses(tmp_path):
    """One rule for the theta (helpers.draft.config_checks.effective_rope): a theta inside rope_parameters wins over
    the top-level one, as transformers 5 loads it for llama.py (found by an adversarial run: the offline run took the
    top-level 10000 while the config checks said SGLang runs 500000); a theta that is not a number is bad input."""
    from helpers.draft.config_checks import effective_rope

    d = _draft(tmp_path, "theta", cfg={"rope_theta": 10000.0,
                                       "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}})
    raw = json.loads((d / "config.json").read_text())
    assert effective_rope(raw)["rope_theta"] == 500000.0
    draft = Eagle3Draft.load(d, REFERENCE_TARGET)
    hd = draft.arch.head_dim
    want = 1.0 / (500000.0 ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    assert draft.arch.rope_theta == 500000.0
    assert torch.allclose(draft.attn._inv.double().cpu(), want, rtol=1e-6)
    bad = _draft(tmp_path, "theta-abc", cfg={"rope_theta": "abc", "rope_parameters": None})
    with pytest.raises(BadInput, match="rope_theta"):
        Eagle3Draft.load(bad, REFERENCE_TARGET)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.int8, torch.bool])
def test_a_quantised_draft_tensor_is_one_line_naming_it(tmp_path, dtype):
    """An FP8 or integer weight (a quantised checkpoint whose scales this run does not apply) is refused naming the
    file and tensor, instead of a crash (FP8) or a silent cast (integer) that would measure another model."""
    d = _draft(tmp_path, str(dtype).split(".")[-1],
               edit=lambda w: w.__setitem__("midlayer.mlp.up_proj.weight",
                                            (w["midlayer.mlp.up_proj.weight"].float() * 100).to(dtype)))
    with pytest.raises(BadInput, match=r"model\.safetensors \[midlayer\.mlp\.up_proj\.weight\]: dtype "
                                       rf"{str(dtype).split('.')[-1]}: not a plain float weight") as e:
        Eagle3Draft.load(d, REFERENCE_TARGET)
    assert "\n" not in str(e.value)
