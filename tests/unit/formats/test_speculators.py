"""speculators-format drafts read as vLLM 0.32.0 reads them (helpers/formats/speculators.py): the reference h64 draft
converted the way speculators' Eagle3SpeculatorConverter does (written to a tmp folder), then read back: the same
draft tensors and the same offline proposals on real training rows, the config-only checks on both engines (vLLM
serves it, SGLang names it unsupported with the conversion), and vLLM's config rules (norm_before_residual default
true, model_type -> class, ids verbatim)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from helpers.diagnosis.static import static_check
from helpers.draft.model import Eagle3Draft
from helpers.draft.sequences import training_sequences
from helpers.engines.vllm_rules import VLLMLoaderRules, VLLMRules
from helpers.errors import BadInput
from helpers.formats.configs import read_draft_config, read_draft_weights, read_target_config
from helpers.formats.speculators import convert_eagle3_to_speculators, vllm_view, vllm_weight_name
from helpers.formats.training_data import TrainingData

ROOT = Path(__file__).resolve().parents[3]
H64 = ROOT / "env" / "models" / "llama_h64"


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> Path:
    return convert_eagle3_to_speculators(H64 / "draft", tmp_path_factory.mktemp("spec") / "draft", H64 / "target")


def _tensors(folder: Path) -> dict:
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def test_the_converter_writes_speculators_names_and_fields(converted):
    raw = json.loads((converted / "config.json").read_text())
    assert raw["speculators_model_type"] == "eagle3" and raw["architectures"] == ["Eagle3Speculator"]
    assert raw["norm_before_residual"] is False and raw["draft_vocab_size"] == 2048
    assert raw["transformer_layer_config"]["vocab_size"] == 4096          # t2d's length, as the converter patches
    assert raw["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    orig, conv = _tensors(H64 / "draft"), _tensors(converted)
    assert not any(k.startswith("midlayer.") for k in conv)
    for k, t in orig.items():                                              # bit for bit, renamed
        assert torch.equal(conv[k.replace("midlayer.", "layers.0.")], t), k
    target = _tensors(H64 / "target")
    assert torch.equal(conv["embed_tokens.weight"], target["model.embed_tokens.weight"])   # from the verifier
    # where vLLM's Eagle3LlamaForCausalLM.load_weights puts each name
    assert vllm_weight_name("layers.0.self_attn.q_proj.weight") == "model.layers.0.self_attn.q_proj.weight"
    assert (vllm_weight_name("d2t"), vllm_weight_name("t2d"), vllm_weight_name("lm_head.weight")) == \
        ("draft_id_to_target_id", None, "lm_head.weight")


def test_the_reader_gives_the_same_draft_and_the_same_offline_proposals(converted):
    a = Eagle3Draft.load(H64 / "draft", H64 / "target")
    b = Eagle3Draft.load(converted, H64 / "target")
    assert a.arch == b.arch and sorted(a.w) == sorted(b.w)
    assert all(torch.equal(a.w[k], b.w[k]) for k in a.w)
    assert torch.equal(a.embed, b.embed) and torch.equal(a.lm_head, b.lm_head)
    assert torch.equal(a.hot_token_id, b.hot_token_id)
    seqs = training_sequences(TrainingData(H64 / "data" / "sample", hidden_size=128, max_samples=2))
    assert len(seqs) == 2
    for s in seqs:
        T = int(s.tokens.shape[0])
        ea, eb = a.extend(s.tokens[1:T], s.aux[: T - 1]), b.extend(s.tokens[1:T], s.aux[: T - 1])
        pa, pb = a.to_target_ids(ea.logits.argmax(-1)), b.to_target_ids(eb.logits.argmax(-1))
        assert torch.equal(ea.logits, eb.logits) and torch.equal(pa, pb)
        # the proposals are the trained draft's: most rows predict the next token of the sequence
        assert float((pa[:-1] == s.tokens[2:T]).float().mean()) > 0.3
        for (ka, ra, la), (kb, rb, lb) in zip(a.ttt_steps(ea, s.tokens, 3), b.ttt_steps(eb, s.tokens, 3)):
            assert ka == kb and torch.equal(ra, rb) and torch.equal(la, lb)


def test_norm_before_residual_is_read_as_vllm_reads_it(converted, tmp_path):
    """vLLM defaults an absent norm_before_residual to true (algos.py::update_eagle3): the offline run then adds the
    normed hidden state as the first layer's residual, and its proposals change."""
    raw = json.loads((converted / "config.json").read_text())
    del raw["norm_before_residual"]
    other = tmp_path / "nbr"
    other.mkdir()
    (other / "config.json").write_text(json.dumps(raw))
    (other / "model.safetensors").symlink_to(converted / "model.safetensors")
    d = read_draft_config(other)
    assert d.raw["norm_before_residual"] is True and d.speculators.defaulted["norm_before_residual"] is True
    a, b = Eagle3Draft.load(converted, H64 / "target"), Eagle3Draft.load(other, H64 / "target")
    assert (a.arch.norm_before_residual, b.arch.norm_before_residual) == (False, True)
    s = training_sequences(TrainingData(H64 / "data" / "sample", hidden_size=128, max_samples=1))[0]
    T = int(s.tokens.shape[0])
    assert not torch.equal(a.extend(s.tokens[1:T], s.aux[: T - 1]).logits,
                           b.extend(s.tokens[1:T], s.aux[: T - 1]).logits)
    checks = VLLMLoaderRules("0.32.0").config_checks(d, read_target_config(H64 / "target"))
    assert not checks.findings and any("norm_before_residual" in n and "true" in n for n in checks.notes)


def test_config_only_checks_vllm_serves_it_and_sglang_names_the_conversion(converted):
    d, t = read_draft_config(converted), read_target_config(H64 / "target")
    assert (d.form, d.architectures, d.speculators.architecture) == ("speculators", ["Eagle3Speculator"],
                                                                     "Eagle3LlamaForCausalLM")
    rules = VLLMRules("0.32.0")
    plan = rules.served_plan(d, t)
    assert plan.tensors == ["out(0)", "out(2)", "out(3)"] and plan.fatal is None       # in(1), in(3), in(4)
    orig = rules.served_plan(read_draft_config(H64 / "draft"), t)
    assert plan.tensors == orig.tensors
    assert rules.setup_findings(d, t, plan, "EAGLE3") == []
    lr = VLLMLoaderRules("0.32.0")
    findings, facts = [], {}
    lr.weights(d, read_draft_weights(converted), t, H64 / "target", findings, facts)
    assert findings == [] and facts["embedding"]["source"] == "target"      # the verifier's embedding: shared
    # SGLang 0.5.23: unsupported, with the config conversion as the fix (ids in SGLang's numbering)
    rep = static_check(converted, H64 / "target")
    un = next(f for f in rep.findings if f["kind"] == "unsupported_draft")
    assert "speculators" in un["detail"] and "[0, 2, 3]" in un["evidence"]["fix"]
    sg = un["evidence"]["sglang_config"]
    assert sg["architectures"] == ["LlamaForCausalLMEagle3"] and sg["eagle_config"][
        "eagle_aux_hidden_state_layer_ids"] == [0, 2, 3] and sg["hidden_size"] == 128


def test_vllm_refuses_what_vllm_refuses_with_the_field_named(tmp_path):
    qwen = vllm_view({"speculators_model_type": "eagle3", "transformer_layer_config": {"model_type": "qwen3"}})
    assert qwen.architecture == "Eagle3Qwen3ForCausalLM" and qwen.problem is None
    gemma = vllm_view({"speculators_model_type": "eagle3", "transformer_layer_config": {"model_type": "gemma"}})
    assert gemma.architecture is None and "Unsupported model_type gemma" in gemma.problem
    p = tmp_path / "config.json"
    p.write_text(json.dumps({"speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"],
                             "transformer_layer_config": {"hidden_size": 64, "model_type": "gemma"}}))
    d = read_draft_config(p)
    f = VLLMRules("0.32.0").setup_findings(d, None, None, "EAGLE3")
    assert [x["kind"] for x in f] == ["unsupported_draft"] and "gemma" in f[0]["detail"]
    p.write_text(json.dumps({"speculators_model_type": "eagle3", "transformer_layer_config": [1]}))
    with pytest.raises(BadInput, match=r"\[transformer_layer_config\].*must be a dictionary"):
        read_draft_config(p)


def test_an_own_embedding_unlike_the_targets_is_kept_as_vllm_keeps_it(converted, tmp_path):
    """vLLM shares the target's embedding only when the draft's equals it (_maybe_share_embeddings): the offline run of
    a speculators draft (served by vLLM only) takes a different one from the checkpoint, and proposes differently."""
    from safetensors.torch import save_file

    other = tmp_path / "own"
    other.mkdir()
    (other / "config.json").write_text((converted / "config.json").read_text())
    w = _tensors(converted)
    g = torch.Generator().manual_seed(0)
    w["embed_tokens.weight"] = (w["embed_tokens.weight"].float()
                                + torch.randn(w["embed_tokens.weight"].shape, generator=g)).to(torch.bfloat16)
    save_file(w, str(other / "model.safetensors"))
    a, b = Eagle3Draft.load(converted, H64 / "target"), Eagle3Draft.load(other, H64 / "target")
    assert a.sources["embed"].startswith("target") and b.sources["embed"].startswith("draft")
    assert torch.equal(b.embed, w["embed_tokens.weight"].float()) and not torch.equal(a.embed, b.embed)
    s = training_sequences(TrainingData(H64 / "data" / "sample", hidden_size=128, max_samples=1))[0]
    T = int(s.tokens.shape[0])
    assert not torch.equal(a.extend(s.tokens[1:T], s.aux[: T - 1]).logits,
                           b.extend(s.tokens[1:T], s.aux[: T - 1]).logits)


def test_diagnose_with_engine_vllm_reads_a_speculators_draft_as_vllm_does(converted, tmp_path, capsys):
    """``diagnose --draft-config SPECULATORS --target-config T --engine vllm`` (refused before: --engine was for MTP
    heads only): the served plan from the speculators config's top-level ids in vLLM's convention, vLLM's config
    reading (speculators fact, norm_before_residual as written / defaulted true with its note), no unsupported_draft;
    without --engine, SGLang's rules name it unsupported."""
    from helpers.cli.diagnose import cli_main

    def run(*argv):
        rc = cli_main(["--draft-config", str(argv[0]), "--target-config", str(H64 / "target"), "--json", *argv[1:]])
        return rc, json.loads(capsys.readouterr().out)

    rc, doc = run(converted, "--engine", "vllm")
    assert rc == 0 and doc["verdict"] == "ok" and doc["findings"] == [], doc["findings"]
    assert doc["served_plan"]["tensors"] == ["out(0)", "out(2)", "out(3)"]
    sp = doc["draft_checks"]["facts"]["speculators"]
    assert sp["vllm_class"] == "Eagle3LlamaForCausalLM" and sp["norm_before_residual"] is False
    assert doc["inputs"]["vllm version"].startswith("0.32.0")
    # the field left out: vLLM reads it as true, and says so
    raw = json.loads((converted / "config.json").read_text())
    del raw["norm_before_residual"]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    rc, doc = run(tmp_path / "config.json", "--engine", "vllm")
    assert doc["draft_checks"]["facts"]["speculators"]["norm_before_residual"] is True
    assert any("reads it as true" in a for a in doc["advisories"]), doc["advisories"]
    rc, doc = run(converted)
    assert rc == 1 and "unsupported_draft" in {f["kind"] for f in doc["findings"]}


def _spec_config(tmp: Path, **top) -> Path:
    """A small speculators eagle3 config (hidden 64, vocab 512) with ``top`` set at the top level."""
    cfg = {"speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"], "draft_vocab_size": 256,
           "norm_before_residual": False, "eagle_aux_hidden_state_layer_ids": [1, 3, 4],
           "transformer_layer_config": {"model_type": "llama", "hidden_size": 64, "vocab_size": 512,
                                        "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 4}}
    cfg.update(top)
    p = tmp / "config.json"
    p.write_text(json.dumps(cfg))
    return p


@pytest.mark.parametrize("field,value,expect", [
    ("norm_before_residual", "yes", "expected true or false, got 'yes'"),
    ("norm_before_residual", "false", "'false' included, reads as true"),
    ("fc_norm", 1, "expected true or false"),
    ("draft_vocab_size", 10 ** 15, "expected an integer 1-512, got 1000000000000000"),
    ("draft_vocab_size", 513, "at most the vocab_size 512"),
    ("eagle_aux_hidden_state_layer_ids", list(range(65)), "expected at most 64 layer ids")])
def test_speculators_fields_vllm_would_misread_or_fail_on_are_exit_2(tmp_path, capsys, field, value, expect):
    """``diagnose --engine vllm`` on a speculators draft: a flag vLLM tests for truth given as a string or int, a
    draft vocabulary past the target's (vLLM builds an lm_head of that many rows), more ids than a draft takes:
    exit 2, one line naming the file and the field."""
    from helpers.cli.diagnose import cli_main
    p = _spec_config(tmp_path, **{field: value})
    rc = cli_main(["--draft-config", str(p), "--target-config", str(H64 / "target"), "--engine", "vllm"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert f"{p} [{field}]" in err and expect in err, err
    ok = _spec_config(tmp_path, **{field: {"norm_before_residual": True, "fc_norm": False, "draft_vocab_size": 512,
                                           "eagle_aux_hidden_state_layer_ids": [1, 2, 3]}[field]})
    assert cli_main(["--draft-config", str(ok), "--target-config", str(H64 / "target"), "--engine", "vllm"]) in (0, 1)
    assert capsys.readouterr().err == ""


def test_the_training_plan_is_linear_in_the_number_of_layer_ids():
    """The read of ids past the bound (the reader refuses them first) stays linear: one short problem per id out
    of range, not the whole list repeated in each (20000 ids took 92 s and 2.8 GB)."""
    import time

    from helpers.diagnosis.conventions import training_plan
    from helpers.formats.configs import read_target_config

    class Draft:
        top_level_layer_ids = tuple(range(-5000, 5000))
        nested_layer_ids = None

    target = read_target_config(H64 / "target")
    t0 = time.perf_counter()
    plan = training_plan(Draft(), target, trainer="speculators")
    took = time.perf_counter() - t0
    n = target.num_hidden_layers
    bad = [p for p in plan.problems if p["kind"] == "missing_chunk"]
    assert plan.tensors == ["embedding"] + [f"out({i})" for i in range(n)] and len(bad) == 10000 - (n + 1)
    assert bad[0]["detail"] == (f"id -5000 of vllm ids (10000 given): vllm id -5000 names no tensor of a {n}-layer "
                                "target")
    assert max(len(p["detail"]) for p in bad) < 200 and took < 1.0, (took, bad[0])
