"""Layer-id conventions (helpers.layers.ids) and capture plans (helpers.diagnosis.conventions), checked against the
rules read in SGLang 0.5.14 / 0.5.23 source; where the reference environment's SGLang is installed, the quoted rules
are also checked against its source text."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from helpers.diagnosis.conventions import compare_plans, served_plan, sglang_layers_to_capture, training_plan
from helpers.layers.ids import LayerIds, convert, layer_id, physical, specforge_default_ids, vllm_default_ids
from helpers.layers.sglang import parse_version, target_family


def draft(nested=None, top=None, use_aux=True, form="sglang"):
    return SimpleNamespace(nested_layer_ids=nested, top_level_layer_ids=top, use_aux_hidden_state=use_aux, form=form)


def target(n, arch="LlamaForCausalLM", model_type="llama"):
    return SimpleNamespace(num_hidden_layers=n, architectures=[arch], model_type=model_type)


def test_physical_names_per_convention():
    n = 32
    assert [physical(i, "specforge", n) for i in (1, 15, 28)] == ["out(1)", "out(15)", "out(28)"]
    assert [physical(i, "vllm", n) for i in (2, 16, 29, 32)] == ["out(1)", "out(15)", "out(28)", "out(31)"]
    assert [physical(i, "sglang_capture", n) for i in (0, 2, 16)] == ["embedding", "out(1)", "out(15)"]
    assert [physical(i, "hf", n) for i in (0, 2, 32)] == ["embedding", "out(1)", "final_norm"]
    assert physical(-1, "specforge", n) == "embedding"
    with pytest.raises(ValueError):
        physical(32, "specforge", n)          # out(32) does not exist
    with pytest.raises(ValueError):
        physical(-1, "sglang_capture", n)
    # all four defaults name the same physical tensors
    assert specforge_default_ids(n).tensors(n) == vllm_default_ids(n).tensors(n) == ["out(1)", "out(15)", "out(28)"]


def test_convert_round_trips():
    ids = LayerIds((1, 15, 28), "specforge")
    v = convert(ids, "vllm", 32)
    assert v == LayerIds((2, 16, 29), "vllm") and str(v) == "vllm=[2, 16, 29]"
    assert convert(v, "specforge", 32) == ids
    assert layer_id("embedding", "hf", 32) == 0 and layer_id("final_norm", "hf", 32) == 32
    with pytest.raises(ValueError):
        layer_id("out(31)", "hf", 32)         # HF index 32 is the normed state, not out(31)


@pytest.mark.parametrize("family,version,ids,expected", [
    ("plus_one", None, None, [2, 16, 29]),                      # default, no +1
    ("plus_one", None, [1, 15, 28], [2, 16, 29]),               # explicit ids +1
    ("deepseek", "0.5.23", [1, 29, 57], [2, 30, 58]),           # first id 1 -> +1
    ("deepseek", "0.5.23", [2, 30, 58], [2, 30, 58]),           # first id != 1 -> as-is (PR #25454)
    ("deepseek", "0.5.14", [2, 30, 58], [2, 30, 58]),           # read in 0.5.14 too
    ("deepseek", "0.5.10", [2, 30, 58], [3, 31, 59]),           # older: +1 assumed (the seed hunt's server)
    ("gpt_oss", "0.5.23", [24, 30, 36], [24, 30, 36]),          # max id == n: boundaries kept
    ("gpt_oss", "0.5.14", [24, 30, 36], [25, 31, 37]),          # legacy +1
    ("plus_one_default", None, None, [3, 17, 30]),              # minimax_m3_vl: +1 on the default too
])
def test_sglang_layers_to_capture(family, version, ids, expected):
    n = 36 if family == "gpt_oss" else 32
    if family == "plus_one_default" or family == "plus_one":
        n = 32
    ltc, rules = sglang_layers_to_capture(ids, n, family, parse_version(version))
    assert ltc == expected
    assert rules and all(".py" in r for r in rules)


def test_served_plan_rules():
    n = 8
    t = target(n)
    assert served_plan(draft(), t).tensors == ["out(1)", "out(3)", "out(4)"]
    assert served_plan(draft([1, 3, 4]), t).tensors == ["out(1)", "out(3)", "out(4)"]
    # unsorted and duplicated ids: ascending order, duplicates captured once
    p = served_plan(draft([4, 1, 1]), t)
    assert p.tensors == ["out(1)", "out(4)"]
    assert any("not ascending" in n for n in p.notes) and any("duplicates" in n for n in p.notes)
    # last layer output unreachable (id n-1 -> index n)
    p = served_plan(draft([1, 3, 7]), t)
    assert p.tensors == ["out(1)", "out(3)"] and p.problems[0]["kind"] == "missing_chunk"
    # id -1: the embedding on 0.5.23 (layer_boundary), a TypeError on 0.5.14 Llama
    assert served_plan(draft([-1, 1, 3]), t, version="0.5.23").tensors == ["embedding", "out(1)", "out(3)"]
    old = served_plan(draft([-1, 1, 3]), t, version="0.5.14")
    assert old.fatal and "TypeError" in old.fatal and old.tensors == ["out(1)", "out(3)"]
    # top-level ids ignored silently, said in a note
    p = served_plan(draft(top=[1, 3, 5]), t)
    assert p.tensors == ["out(1)", "out(3)", "out(4)"]
    assert any("top-level" in n and "silently falls back" in n for n in p.notes)
    # no aux capture
    assert served_plan(draft([1, 3, 4]), t, algorithm="EAGLE").tensors == ["final_norm"]
    assert served_plan(draft([1, 3, 4], use_aux=False), t).tensors == ["final_norm"]
    # another engine's plan is its adapter's rules (tests/unit/engines/test_vllm_rules.py), never a branch here
    with pytest.raises(ValueError, match="adapter"):
        served_plan(draft(top=[2, 4, 5]), t, engine="vllm")
    with pytest.raises(ValueError):
        served_plan(draft(), t, algorithm="NGRAM")


def test_served_plan_deepseek_family_and_the_seed_config():
    kimi = target(61, "KimiK25ForConditionalGeneration", "kimi_k25")
    assert target_family(kimi.architectures, kimi.model_type) == "deepseek"
    # the seed hunt's trained config [2, 30, 58] on 0.5.23: no +1 because the first id is not 1
    p = served_plan(draft([2, 30, 58]), kimi, version="0.5.23")
    assert p.tensors == ["out(1)", "out(29)", "out(57)"]
    trained = training_plan(draft([2, 30, 58]), kimi, "specforge")
    assert trained.tensors == ["out(2)", "out(30)", "out(58)"]
    assert [r["offset"] for r in compare_plans(p, trained)] == [-1, -1, -1]
    # on a pre-#25454 server it was +1 -> correct
    assert served_plan(draft([2, 30, 58]), kimi, version="0.5.10").tensors == trained.tensors
    # [-1, 2, 30] (the seed's patch config) on 0.5.23: ids as-is -> -1 never reached, packer RuntimeError
    p = served_plan(draft([-1, 2, 30]), kimi, version="0.5.23")
    assert p.tensors == ["out(1)", "out(29)"] and "RuntimeError" in p.fatal


def test_deepseek_unreached_ids_raise_at_the_first_forward_not_silently_missing():
    """0.5.23's DeepSeek family packs the captures (AuxHiddenStatePacker): an id naming the last layer or a negative id
    without first id 1 is never reached and the first forward (the start-up warm-up) raises; checked live in
    tests/server/test_kimi_rules_live.py. -1 with first id 1 is capture index 0, the embedding, packed in layer order."""
    ds = target(8, "DeepseekV3ForCausalLM", "deepseek_v3")
    for ids in ([1, 3, 7], [2, 4, -1], [2, 4, 8], [1, 3, 3]):
        p = served_plan(draft(ids), ds, version="0.5.23")
        assert p.fatal and "RuntimeError 'captured 2 of 3 aux hidden states'" in p.fatal, ids
        assert "start-up warm-up" in p.fatal
        assert not any("silently" in x["detail"] for x in p.problems), ids
    p = served_plan(draft([1, 3, -1]), ds, version="0.5.23")
    assert p.fatal is None and p.tensors == ["embedding", "out(1)", "out(3)"]
    assert p.problems[0]["kind"] == "embedding_in_place_of_layer"
    # a Llama target leaves the unreached chunk out, silently (AuxHiddenStateList): no fatal
    p = served_plan(draft([1, 3, 7]), target(8), version="0.5.23")
    assert p.fatal is None and p.tensors == ["out(1)", "out(3)"] and "silently" in p.problems[0]["detail"]


def test_gpt_oss_boundary_is_version_dependent():
    t = target(36, "GptOssForCausalLM", "gpt_oss")
    assert served_plan(draft([24, 30, 36]), t, version="0.5.23").tensors == ["out(23)", "out(29)", "out(35)"]
    assert served_plan(draft([24, 30, 36]), t, version="0.5.14").tensors == ["out(24)", "out(30)"]


def test_training_plans():
    t = target(8)
    assert training_plan(draft(), t, "specforge").tensors == ["out(1)", "out(3)", "out(4)"]
    assert training_plan(draft([1, 3, 5]), t, "specforge").tensors == ["out(1)", "out(3)", "out(5)"]
    assert training_plan(draft(), t, "specforge", override_ids=[2, 3, 4]).tensors == ["out(2)", "out(3)", "out(4)"]
    assert training_plan(draft(top=[2, 4, 5]), t, "speculators").tensors == ["out(1)", "out(3)", "out(4)"]
    assert training_plan(None, t, "eagle3").tensors == ["out(1)", "out(3)", "out(4)"]
    assert training_plan(None, t, "eagle12").tensors == ["final_norm"]
    # id -1: no SpecForge run can use it; through SGLang's +1 rule it is capture index 0 = the embedding. The id is
    # kept (three chunks, as the draft's fc) and the two readings are recorded, never dropped silently
    p = training_plan(draft([-1, 1, 3]), t, "specforge")
    assert p.tensors == ["embedding", "out(1)", "out(3)"] and "non-negative" in p.notes[-1]
    assert [r["tensors"] for r in p.ambiguity["readings"]] == [["embedding", "out(1)", "out(3)"],
                                                               ["<id -1: unknown>", "out(1)", "out(3)"]]


def test_training_plan_never_drops_an_id():
    # id n cannot be out(n): only the capture-boundary reading names all three (gpt_oss.py keeps such ids)
    p = training_plan(draft([4, 6, 8]), target(8, "GptOssForCausalLM", "gpt_oss"), "specforge")
    assert p.tensors == ["out(3)", "out(5)", "out(7)"] and p.problems == [] and p.ambiguity is None
    assert str(p.config_ids) == "sglang_capture=[4, 6, 8]" and "capture-boundary" in p.notes[-1]
    # Qwen3-MoE flags self.layers[k]: id -5 -> capture index -4 wraps to layer n-4 = in(n-4) = out(n-5)
    p = training_plan(draft([-5, 1, 2]), target(8, "Qwen3MoeForCausalLM", "qwen3_moe"), "specforge")
    assert p.tensors == ["out(1)", "out(2)", "out(3)"] and "Qwen3MoeForCausalLM" in p.ambiguity["readings"][0]["reading"]
    # Llama never reaches capture index -4 and no reading names -5: unknown, flagged, nothing dropped silently
    p = training_plan(draft([-5, 1, 3]), target(8), "specforge")
    assert p.tensors == [] and p.problems[0]["kind"] == "missing_chunk" and "unknown" in p.problems[0]["detail"]
    # top-level ids (no eagle_config) are what the config claims: read as out(i), as detect_config_ids_ignored does
    p = training_plan(draft(top=[2, 4, 5]), target(8), "specforge")
    assert p.tensors == ["out(2)", "out(4)", "out(5)"] and "top level" in p.notes[0]
    # a repeated id is named once, and the plan says so (SpecForge trains on three distinct ids)
    p = training_plan(draft([1, 5, 5]), target(8), "specforge")
    assert p.tensors == ["out(1)", "out(5)"] and any("5 repeated in [1, 5, 5]" in n for n in p.notes)


def test_served_plan_negative_ids_and_empty_ids():
    qwen = target(48, "Qwen3MoeForCausalLM", "qwen3_moe")
    # qwen2_moe.py Qwen2MoeModel.set_eagle3_layers_to_capture: setattr(self.layers[-4], ...) -> layer 44 = out(43)
    p = served_plan(draft([-5, 15, 28]), qwen)
    assert p.tensors == ["out(15)", "out(28)", "out(43)"] and p.fatal is None and p.problems == []
    assert any("self.layers[-4]" in n for n in p.notes)
    p = served_plan(draft([-50, 15, 28]), qwen)                          # -49 < -n: IndexError at start-up
    assert p.fatal and "IndexError" in p.fatal
    # llama.py tests `i in self.layers_to_capture`: a negative index is never reached
    p = served_plan(draft([-5, 15, 28]), target(32))
    assert p.tensors == ["out(15)", "out(28)"] and "never reached" in p.problems[0]["detail"] and p.fatal is None
    # [] -> layers_to_capture [] but capture_aux_hidden_states True: the bare tensor is unpacked (ValueError)
    for t in (target(32), qwen, target(61, "DeepseekV3ForCausalLM", "deepseek_v3")):
        p = served_plan(draft([]), t)
        assert p.tensors == [] and p.fatal and "ValueError" in p.fatal and "unpacks" in p.fatal


SGLANG = Path("/work/main/env/reference/.venv/lib/python3.11/site-packages/sglang")
SOURCE_QUOTES = [
    ("srt/models/llama.py", "self.model.layers_to_capture = [val + 1 for val in layer_ids]"),
    ("srt/models/llama.py", "self.model.layers_to_capture = [2, num_layers // 2, num_layers - 3]"),
    ("srt/models/deepseek_v2.py", "if layer_ids and layer_ids[0] == 1:"),
    ("srt/models/gpt_oss.py", "if layer_ids and max(layer_ids) == num_layers:"),
    ("srt/model_executor/model_runner_components/spec_aux_hidden_state.py",
     "config.eagle_aux_hidden_state_layer_ids = eagle_config["),
    ("srt/models/llama_eagle3.py", "if hidden_states.shape[-1] != embeds.shape[-1]:"),
    ("srt/arg_groups/speculative_hook.py", "speculative_num_draft_tokens is adjusted to speculative_num_steps + 1"),
    ("srt/layers/aux_hidden_states.py", "captured {self._idx} of {self._num_captures} aux hidden states"),
    ("srt/models/deepseek_v2.py", "aux_hidden_states = AuxHiddenStatePacker(len(self.layers_to_capture))"),
    ("srt/models/qwen2_moe.py", 'setattr(self.layers[layer_id], "_is_layer_to_capture", True)'),
    ("srt/models/llama.py", "hidden_states, aux_hidden_states = hidden_states"),
    ("srt/models/llama_eagle3.py", "self.num_aux_hidden_states = len(layer_ids) if layer_ids else 3"),
    ("srt/utils/json_response.py", "orjson.dumps(content, option=ORJSON_RESPONSE_OPTIONS)"),
]


@pytest.mark.skipif(not SGLANG.exists(), reason="reference SGLang not installed")
@pytest.mark.parametrize("rel,quote", SOURCE_QUOTES)
def test_rules_still_match_installed_sglang_source(rel, quote):
    assert quote in (SGLANG / rel).read_text(), f"{rel} no longer contains the rule conventions.py mirrors"
