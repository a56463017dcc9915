"""The proposed fix (helpers.investigation.propose) from real diagnoses of a deep synthetic target with real
residual-stream statistics (tests/support/realistic.py): the ids come from running SGLang's id rules, engine faults
are named as engine changes, and a draft variant really carries the fix."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers.diagnosis.diagnose import diagnose
from helpers.formats.configs import read_draft_config, read_target_config
from helpers.investigation.propose import draft_variant, ids_for_plan, propose_fix
from support.realistic import World, outs

N = 32
TRAINED = [1, 15, 28]          # SpecForge out(i) ids (the default [1, n//2-1, n-4] for n = 32)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return World.make(tmp_path_factory.mktemp("propose"), layers=N, hidden=256)


@pytest.fixture(scope="module")
def training(world):
    return world.training(outs(TRAINED), manifest_ids=TRAINED)


def _diagnose(world, training, draft_ids, served_tensors, *, reference=True, mutate=None, **cfg):
    draft, target = world.configs(draft_ids, **cfg)
    served = world.served_json(served_tensors, mutate=mutate)
    d = diagnose(training, [served], draft_config=draft / "config.json", target_config=target / "config.json",
                 reference=world.reference() if reference else None)
    return d, read_draft_config(draft / "config.json"), read_target_config(target / "config.json")


@pytest.mark.parametrize("arch, wanted, ids", [
    ("LlamaForCausalLM", ["out(1)", "out(15)", "out(28)"], [1, 15, 28]),          # +1 rule: SpecForge ids
    ("DeepseekV3ForCausalLM", ["out(1)", "out(15)", "out(28)"], [1, 15, 28]),     # first id 1: +1
    ("DeepseekV3ForCausalLM", ["out(2)", "out(15)", "out(28)"], [3, 16, 29]),     # first id != 1: ids as capture
    ("GptOssForCausalLM", ["out(1)", "out(15)", "out(31)"], [1, 15, 31]),         # +1: index n = final boundary
])
def test_ids_for_plan_runs_the_sglang_rules(tmp_path, world, arch, wanted, ids):
    draft, target = world.configs([0, 1, 2], architecture=arch)
    got, plan, why = ids_for_plan(wanted, read_draft_config(draft / "config.json"),
                                  read_target_config(target / "config.json"), "0.5.23")
    assert got == ids, why
    assert plan.tensors == wanted and plan.fatal is None


def test_ids_for_plan_says_why_nothing_works(world):
    draft, target = world.configs([1, 2, 3])
    d, t = read_draft_config(draft / "config.json"), read_target_config(target / "config.json")
    assert ids_for_plan(["out(15)", "out(1)"], d, t, "0.5.23")[0] is None          # SGLang is ascending
    ids, _, why = ids_for_plan(["out(1)", "final_norm"], d, t, "0.5.23")
    assert ids is None and "final_norm" in why
    ids, _, why = ids_for_plan(["out(1)", "out(31)"], d, t, "0.5.23")             # Llama never reaches out(n-1)
    assert ids is None and "out(31)" in why


def test_edited_config_gets_the_trained_ids_back(world, training):
    # the seeds' edit on a 32-layer target: the embedding first, every layer one chunk later
    d, draft, target = _diagnose(world, training, [-1, 1, 15], ["embedding", "out(1)", "out(15)"])
    assert d.findings and d.findings[0]["kind"] in ("config_ids_mismatch", "embedding_in_place_of_layer")
    fix = propose_fix(d, draft=draft, target=target, version="0.5.23", algorithm="EAGLE3")
    assert fix.kind == "config" and fix.applicable
    assert fix.draft_config == {"eagle_config": {"eagle_aux_hidden_state_layer_ids": TRAINED}}
    assert fix.expected_served == outs(TRAINED)
    assert any("manifest" in w for w in fix.why) and any("+1" in w or "i+1" in w for w in fix.why)
    assert "embedding_in_place_of_layer" in fix.addresses and not fix.engine


def test_offset_the_rules_do_not_explain_is_an_engine_fault_with_a_stopgap(world, training):
    # the config is right, but the server feeds every layer one later (a patched capture / a hook)
    d, draft, target = _diagnose(world, training, TRAINED, outs([i + 1 for i in TRAINED]))
    assert d.findings[0]["kind"] == "layer_offset"
    fix = propose_fix(d, draft=draft, target=target, version="0.5.23", algorithm="EAGLE3",
                      hooks=[{"name": "mystery", "target_modules": ["model.layers.3"]}])
    assert fix.kind == "engine" and not fix.applicable and not fix.draft_config
    assert "out(2), out(16), out(29)" in fix.engine[0] and "mystery on model.layers.3" in fix.engine[-1]
    assert fix.workaround["draft_config"]["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 14, 27]


def test_without_a_reference_the_rule_based_fix_still_comes_from_the_configs(world, training):
    d, draft, target = _diagnose(world, training, [2, 16, 29], outs([2, 16, 29]), reference=False)
    fix = propose_fix(d, draft=draft, target=target, version="0.5.23", algorithm="EAGLE3")
    assert fix.draft_config == {"eagle_config": {"eagle_aux_hidden_state_layer_ids": TRAINED}}


def test_rotated_chunk_is_an_engine_change(world, training):
    d, draft, target = _diagnose(world, training, TRAINED, outs(TRAINED), mutate=_rotate_chunk(1, 256))
    kinds = [f["kind"] for f in d.findings]
    assert "rotated_basis" in kinds, kinds
    fix = propose_fix(d, draft=draft, target=target, version="0.5.23", algorithm="EAGLE3")
    assert not fix.applicable and fix.kind == "engine"
    assert any("basis" in e and "chunk 1" in e for e in fix.engine)
    assert "rotated_basis" in fix.unaddressed


def _rotate_chunk(c, H):
    q, _ = torch.linalg.qr(torch.randn(H, H, generator=torch.Generator().manual_seed(7), dtype=torch.float64))

    def mutate(_, rows):
        out = rows.clone()
        out[:, c * H:(c + 1) * H] = (rows[:, c * H:(c + 1) * H].double() @ q).to(rows.dtype)
        return out
    return mutate


def test_algorithm_eagle_and_missing_vocab_map(tmp_path, world, training):
    d, draft, target = _diagnose(world, training, TRAINED, outs(TRAINED))
    fake = type("D", (), {})()
    fake.findings = [{"kind": "fc_bypassed", "chunk": None, "detail": "EAGLE", "evidence": {}},
                     {"kind": "vocab_map_missing", "chunk": None, "detail": "no d2t", "evidence": {}}]
    fake.chunks, fake.training_plan, fake.served_plan = d.chunks, d.training_plan, d.served_plan
    vm = tmp_path / "data" / "vocab_mapping"
    vm.mkdir(parents=True)
    torch.save({"d2t": torch.arange(8), "t2d": torch.ones(16, dtype=torch.bool)}, vm / "vocab_mapping.pt")
    fix = propose_fix(fake, draft=draft, target=target, version="0.5.23", algorithm="EAGLE",
                      training_dir=tmp_path / "data")
    assert fix.server_args == {"--speculative-algorithm": "EAGLE3"}
    assert fix.add_tensors == {"d2t": str(vm / "vocab_mapping.pt"), "t2d": str(vm / "vocab_mapping.pt")}
    assert fix.kind == "config" and set(fix.addresses) == {"fc_bypassed", "vocab_map_missing"}
    nothing = propose_fix(type("D", (), {"findings": [], "chunks": [], "training_plan": None,
                                         "served_plan": None})())
    assert nothing.kind == "none" and not nothing.applicable


def test_draft_variant_applies_config_and_tensors(tmp_path):
    src = tmp_path / "draft"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"a": 1, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0],
                                                                          "keep": True}, "gone": 3}))
    save_file({"w": torch.ones(2, 2), "t2d": torch.zeros(4, dtype=torch.bool)}, str(src / "model.safetensors"))
    (src / "notes.txt").write_text("x")
    vm = tmp_path / "vocab_mapping.pt"
    torch.save({"d2t": torch.tensor([3, 1, 4]), "t2d": torch.ones(4, dtype=torch.bool)}, vm)
    out = draft_variant(src, {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 4]}, "gone": None},
                        tmp_path / "fixed", add_tensors={"d2t": str(vm), "t2d": str(vm)})
    cfg = json.loads((out / "config.json").read_text())
    assert cfg == {"a": 1, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 4], "keep": True}}
    w = load_file(str(out / "model.safetensors"))
    assert w["d2t"].tolist() == [3, 1, 4] and w["t2d"].all() and torch.equal(w["w"], torch.ones(2, 2))
    assert (out / "notes.txt").is_symlink() and not (out / "model.safetensors").is_symlink()
    assert json.loads((src / "config.json").read_text())["gone"] == 3          # the source is untouched
    assert draft_variant(src, {}, tmp_path / "same") == src
    with pytest.raises(ValueError, match="no tensor 'nope'"):
        draft_variant(src, {}, tmp_path / "bad", add_tensors={"nope": str(vm)})
    assert Path(out).name == "fixed"


def test_a_training_plan_of_another_length_than_the_draft_reads_is_not_proposed(world):
    """Training data of four chunks for a draft whose fc reads three: ids that feed the four would make a server
    that does not start (fc width), so none are proposed and the fix says why."""
    four = [1, 8, 15, 28]
    training = world.training(outs(four), manifest_ids=four)
    d, draft, target = _diagnose(world, training, [2, 16, 29], outs([2, 16, 29]), reference=False)
    assert draft.sglang_num_aux == 3 and len(d.training_plan.tensors) == 4
    fix = propose_fix(d, draft=draft, target=target, version="0.5.23", algorithm="EAGLE3")
    ids = ((fix.draft_config or {}).get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    assert ids is None or len(ids) == 3, fix
    assert any("4 chunks while the draft reads 3" in e for e in fix.engine), fix.engine
