"""The fault generator on every served system (tests/support/faultgen.py SYSTEMS): each class drawn from the system's
own checkpoint, id rules and options, so the faults a live run starts are real faults of that system and start."""
from __future__ import annotations

import json

import pytest
from safetensors import safe_open

from support.faultgen import LLAMA, SYSTEMS, TRAINED_PLAN, GenFault, draw, draws


@pytest.mark.parametrize("name", sorted(SYSTEMS))
def test_wiring_draws_are_served_as_another_plan_by_the_systems_own_rules(name):
    """Every drawn id triple is one the engine serves (no start-up or first-forward error, three chunks: DeepSeek's
    packer raises on a capture that never happens) and serves as another plan than the trained out(1), out(3),
    out(4)."""
    s = SYSTEMS[name]
    seen = set()
    for seed in range(40):
        f = draw(seed, "layer_offset", system=s)
        plan = s.plan_for(f.params["ids"])
        assert plan.fatal is None and len(plan.tensors) == 3, (name, f.params, plan.fatal)
        assert tuple(plan.tensors) != TRAINED_PLAN and f.served_plan() == list(plan.tensors)
        seen.add(tuple(f.params["ids"]))
    assert len(seen) >= 4                                   # not one triple over and over


def test_the_deepseek_rule_decides_which_ids_are_a_fault():
    """On the Kimi-class target [2, 4, 5] are capture indices (the first id is not 1) and serve the trained plan:
    not a fault there, while [1, 3, 4] gets +1 and serves it too; [1, 3, 7] would capture past the last layer."""
    k = SYSTEMS["kimi"]
    assert tuple(k.plan_for([2, 4, 5]).tensors) == TRAINED_PLAN and not k.wiring_ok([2, 4, 5])
    assert tuple(k.plan_for([1, 3, 4]).tensors) == TRAINED_PLAN
    assert k.plan_for([1, 3, 7]).fatal and not k.wiring_ok([1, 3, 7])


def test_a_clean_vllm_server_gets_the_ids_vllm_reads_as_the_training_plan(tmp_path):
    """vLLM reads the ids verbatim as in(i): the clean draft copy says [2, 4, 5], which vLLM serves as out(1),
    out(3), out(4); the shipped [1, 3, 4] would be a wiring fault there."""
    v = SYSTEMS["vllm"]
    d = GenFault(1, "clean", {}, v).draft_copy(tmp_path / "d")
    ids = json.loads((d / "config.json").read_text())["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    assert ids == [2, 4, 5] and tuple(v.plan_for(ids).tensors) == TRAINED_PLAN
    assert tuple(v.plan_for([1, 3, 4]).tensors) != TRAINED_PLAN
    args = GenFault(1, "clean", {}, v).server_args()
    assert args[:4] == ["--engine", "vllm", "--target", str(v.target)] and "--topk" not in args
    assert {f.cls for f in draws(20, 3, system=v)} <= set(v.classes) and "hook" not in v.classes


@pytest.mark.parametrize("name", ["kimi-mla", "vllm"])
def test_tensor_faults_damage_a_tensor_of_that_draft(tmp_path, name):
    s = SYSTEMS[name]
    f = next(f for f in draws(30, 1, system=s) if f.cls == "tensor")
    with safe_open(str(s.draft / "model.safetensors"), "pt") as a:
        keys = set(a.keys())
    assert f.params["tensor"] in keys
    out = f.draft_copy(tmp_path / "d")
    with safe_open(str(out / "model.safetensors"), "pt") as a, safe_open(str(s.draft / "model.safetensors"), "pt") as b:
        changed = [k for k in keys if not a.get_tensor(k).equal(b.get_tensor(k))]
    assert changed == [f.params["tensor"]]


def test_the_llama_reference_draws_are_the_recorded_ones():
    """The Llama reference keeps the draws bench/RESULTS.md recorded (seed 0): adding systems changed no seed."""
    labels = [f.label for f in draws(7, 0)]
    assert labels[:6] == ["chunk order [2, 1, 0]", "d2t 8% of slots permuted", "tensor self_attn.q_proj zero_rows 36%",
                          "clean", "steps 2 topk 1 draft tokens 3", "config ids [1, 4, 5]"]
    assert all(f.system is None and f.sys is LLAMA for f in draws(7, 0))


@pytest.mark.parametrize("name", sorted(SYSTEMS))
def test_hook_faults_name_modules_the_engines_draft_class_has(name):
    """A ``hook`` fault's modules exist in the engine's draft class, by SGLang's parameter names
    (helpers.draft.params mirrors each class's construction): a hook on a name the draft does not have is never
    registered and the fault would be a clean server (the MLA draft's layer is ``model.midlayer``, not
    ``model.layers.0``)."""
    from helpers.draft.params import sglang_parameters
    from helpers.formats.configs import read_draft_config

    s = SYSTEMS[name]
    names = {k[0] for k in sglang_parameters(read_draft_config(s.draft / "config.json")).params}
    for m in s.draft_only_modules:
        assert f"{m}.weight" in names, (name, m, sorted(names)[:8])
    if "hook" in s.classes:
        f = draw(3, "hook", system=s)
        assert set(f.params["modules"]) <= set(s.draft_only_modules)


def test_a_class_is_drawn_from_the_systems_own_classes():
    """Without a class named, a vLLM draw never lands on a class vLLM does not take (hooks, chunk order); a class
    list with none for the system is one clear error."""
    v = SYSTEMS["vllm"]
    assert {draw(seed, system=v).cls for seed in range(40)} <= set(v.classes)
    with pytest.raises(ValueError, match="none of the classes"):
        draws(3, 0, classes=["hook"], system=v)
