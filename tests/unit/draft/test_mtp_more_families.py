"""Config-only checks of the MTP families added for issue 37 part 5 (LongCat-Flash, MiMo-V2), the live path's head
depth (part 3: the layers the serving engine builds, not the declared count) and the acceptance budget's console line
before and after the engine-state probes.

The configs are minimal dicts of the fields the checks read, with the values of the engines' own config classes:
LongCat-Flash from SGLang 0.5.23's ``sglang/srt/configs/longcat_flash.py::LongcatFlashConfig.__init__`` defaults
(l. 15-55: vocab 131072, hidden 6144, num_layers 28, num_nextn_predict_layers 1, model_type ``longcat_flash``);
MiMo-V2-Flash from transformers 5.19's ``models/mimo_v2_flash/configuration_mimo_v2_flash.py::MiMoV2FlashConfig``
(l. 48-81: model_type ``mimo_v2_flash``, vocab 152576, hidden 4096, 48 layers; the class has no
``num_nextn_predict_layers``: the 3 in the fixture is a declared count, to show what each engine makes of it).
That SGLang's own ``ModelConfig`` rewrites both into the head classes named here is checked by
``tests/unit/draft/test_mtp_checks.py::test_sglang_builds_the_head_the_checks_name``."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from helpers.__main__ import main
from helpers.draft.loader import load_draft
from helpers.draft.mtp_checks import MTPRules, MTPSpec, check_mtp
from helpers.draft.nextn_stage import steps_check
from helpers.engines.vllm_rules import VLLMMTPRules
from helpers.errors import BadInput
from helpers.investigation.engine_stage import PROVISIONAL, budget_line, final_budget_line, run_engine_state
from helpers.investigation.mtp import head_depth
from support import DATA
from support.mtp_folders import config_folder as _folder

MTP = DATA / "mtp_configs"
#: tests/data/mtp_configs/README.md says where each field comes from
LONGCAT = json.loads((MTP / "longcat-flash_defaults.json").read_text())
MIMO_V2 = json.loads((MTP / "mimo-v2-flash_defaults.json").read_text())
#: a MiMo-V2 MTP layer's tensors under model.mtp.layers.<i>. (sglang/srt/models/mimo_v2_nextn.py::MiMoV2MTP)
MIMO_V2_LAYER = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "final_layernorm.weight", "input_layernorm.weight",
                 "pre_mlp_layernorm.weight")


def _kinds(rep) -> list[str]:
    return [f["kind"] for f in rep.findings]


def _one(rep, kind: str) -> dict:
    fs = [f for f in rep.findings if f["kind"] == kind]
    assert len(fs) == 1, rep.findings
    return fs[0]


def test_longcat_flash_sglang_loads_model_mtp_layers_0_and_reruns_its_one_layer(tmp_path):
    d = _folder(tmp_path, "lc", LONGCAT)
    rep = check_mtp(d, d, spec=MTPSpec("NEXTN", 1, 1, 2))
    loads = rep.draft_checks["facts"]["loads"]
    assert rep.findings == [] and loads["class"] == "LongcatFlashForCausalLMNextN"
    assert loads["prefixes"] == ["model.mtp.layers.0."] and loads["layers_loaded"] == 1
    assert "stays null" in loads["draft_path"] and "longcat_flash_nextn.py" in loads["file"]
    # the field left out: SGLang's LongcatFlashConfig defaults it to 1 (vLLM's getattr too)
    absent = _folder(tmp_path, "absent", LONGCAT, num_nextn_predict_layers=None)
    head = check_mtp(absent, absent, spec=MTPSpec("NEXTN", 1, 1, 2)).draft_checks["facts"]["head"]
    assert (head["layers"], head["layers_defaulted"]) == (1, True)
    # 3 steps (or 2 declared layers): SGLang builds one layer and runs it 3 times
    two = _folder(tmp_path, "two", LONGCAT, num_nextn_predict_layers=2)
    rep = check_mtp(two, two, spec=MTPSpec("NEXTN", 3, 1, 4))
    f = _one(rep, "mtp_steps_beyond_head")["evidence"]
    assert (f["num_steps"], f["head_layers"], f["layers_declared"]) == (3, 1, 2)
    assert any("SGLang builds 1 head layer" in n and "not read" in n for n in rep.draft_checks["notes"])
    # no steps given: SGLang's _auto_choose_speculative_params picks (3, 1, 4) for this target, over the one layer
    auto = check_mtp(d, d, spec=MTPSpec("NEXTN"))
    s = auto.draft_checks["facts"]["settings"]
    assert (s["num_steps"], s["topk"], s["num_draft_tokens"]) == (3, 1, 4)
    assert _one(auto, "mtp_steps_beyond_head")["evidence"]["head_layers"] == 1


def test_longcat_flash_vllm_builds_one_layer_whatever_n_predict(tmp_path):
    two = _folder(tmp_path, "two", LONGCAT, num_nextn_predict_layers=2)
    rep = check_mtp(two, two, spec=MTPSpec(), rules=VLLMMTPRules())
    loads = rep.draft_checks["facts"]["loads"]
    assert loads["class"].startswith("LongCatFlashMTP") and loads["n_predict"] == 2
    assert loads["prefixes"] == ["model.mtp.layers.0."] and loads["layers_loaded"] == 1
    # num_speculative_tokens defaults to n_predict = 2, over the one layer LongCatMultiTokenPredictor builds
    f = _one(rep, "mtp_steps_beyond_head")["evidence"]
    assert (f["num_steps"], f["head_layers"]) == (2, 1) and "longcat_flash_mtp.py" in f["source"]
    one = _folder(tmp_path, "one", LONGCAT)
    assert check_mtp(one, one, spec=MTPSpec(), rules=VLLMMTPRules()).findings == []


def test_longcat_flash_head_tensors_by_name_and_the_missing_norm_served_as_ones(tmp_path):
    p = "model.mtp.layers.0."
    full = [p + t for t in ("enorm.m.weight", "hnorm.m.weight", "eh_proj.weight", "input_layernorm.weight",
                            "post_attention_layernorm.weight")] + ["model.mtp.norm.weight"]
    ok = _folder(tmp_path, "ok", LONGCAT, index=full)
    assert check_mtp(ok, ok, spec=MTPSpec("NEXTN", 1, 1, 2)).findings == []
    cut = _folder(tmp_path, "cut", LONGCAT, index=[k for k in full if "hnorm" not in k])
    f = _one(check_mtp(cut, cut, spec=MTPSpec("NEXTN", 1, 1, 2)), "mtp_weights_missing")
    assert f["evidence"]["missing"] == {p: [p + "hnorm.m.weight"]} and "-> ones (RMSNorm init)" in f["detail"]
    v = _one(check_mtp(cut, cut, spec=MTPSpec(num_steps=1), rules=VLLMMTPRules()), "mtp_weights_missing")
    assert "vLLM refuses to start" in v["detail"]


def test_mimo_v2_sglang_with_nextn_sets_one_layer_and_folds_the_others_into_it(tmp_path):
    """--speculative-algorithm NEXTN: _mimo_v2_overrides tests speculative_algorithm == "EAGLE" before NEXTN is
    aliased, so SGLang builds one MiMoV2MTP and its loader folds every model.mtp.layers.<i> into it."""
    d = _folder(tmp_path, "m2", MIMO_V2)
    rep = check_mtp(d, d, spec=MTPSpec("NEXTN", 3, 1, 4))
    loads = rep.draft_checks["facts"]["loads"]
    assert loads["class"] == "MiMoV2MTP" and loads["rewrite"].endswith("num_nextn_predict_layers = 1")
    assert loads["prefixes"] == ["model.mtp.layers.0."] and (loads["layers_declared"], loads["layers_loaded"]) == (3, 1)
    assert loads["multi_layer_eagle"] is False
    f = _one(rep, "mtp_steps_beyond_head")["evidence"]
    assert (f["num_steps"], f["head_layers"]) == (3, 1)
    assert any("each overwriting the layer read before it" in n for n in rep.draft_checks["notes"])
    assert _kinds(check_mtp(d, d, spec=MTPSpec("EAGLE3", 1, 1, 2))) == ["mtp_head_refused"]
    # lower-case "eagle" is upper-cased only after the override ran: one folded layer too
    low = check_mtp(d, d, spec=MTPSpec("eagle", 3, 1, 4))
    assert low.draft_checks["facts"]["loads"]["layers_loaded"] == 1 and "mtp_steps_beyond_head" in _kinds(low)


def test_mimo_v2_sglang_with_eagle_builds_one_head_per_step_each_reading_its_own_layer(tmp_path):
    """MiMo-V2-Flash's published command (EAGLE, 3 steps, topk 1, 4 draft tokens): _mimo_v2_overrides enables
    multi-layer EAGLE, tp_worker builds one draft model per step and _filter_mtp_weights gives step i layer i."""
    names = [f"model.mtp.layers.{i}.{t}" for i in range(3) for t in MIMO_V2_LAYER] + ["model.embed_tokens.weight"]
    d = _folder(tmp_path, "m2", MIMO_V2, index=names)
    rep = check_mtp(d, d, spec=MTPSpec("EAGLE", 3, 1, 4))
    loads = rep.draft_checks["facts"]["loads"]
    assert rep.findings == [] and rep.verdict == "ok" and loads["multi_layer_eagle"] is True
    assert loads["prefixes"] == ["model.mtp.layers.0.", "model.mtp.layers.1.", "model.mtp.layers.2."]
    assert (loads["layers_declared"], loads["layers_loaded"]) == (3, 3)
    assert "_mimo_v2_overrides" in loads["loader"] and "_filter_mtp_weights" in loads["loader"]
    # the same checkpoint under NEXTN: folded (layers [0, 1, 2] into one block) and 3 steps over one layer
    assert sorted(_kinds(check_mtp(d, d, spec=MTPSpec("NEXTN", 3, 1, 4)))) == ["mtp_layer_folded",
                                                                              "mtp_steps_beyond_head"]
    # 4 steps over 3 layers: step 4 finds no model.mtp.layers.3 and SGLang starts anyway (no refusal in the loader)
    f = _one(check_mtp(d, d, spec=MTPSpec("EAGLE", 4, 1, 5)), "mtp_weights_missing")
    assert list(f["evidence"]["missing"]) == ["model.mtp.layers.3."] and "SGLang starts anyway" in f["detail"]
    assert "refused" not in f["evidence"]
    cfg_only = _folder(tmp_path, "cfg", MIMO_V2)          # no tensor names: the steps past the declared layers
    f = _one(check_mtp(cfg_only, cfg_only, spec=MTPSpec("EAGLE", 4, 1, 5)), "mtp_steps_beyond_head")["evidence"]
    assert (f["num_steps"], f["head_layers"]) == (4, 3) and "--speculative-num-steps 3" in f["fix"]
    # multi-layer EAGLE asserts draft tokens == steps + 1 (topk 2, 5 draft tokens over 3 steps)
    f = _one(check_mtp(d, d, spec=MTPSpec("EAGLE", 3, 2, 5)), "mtp_head_refused")["evidence"]
    assert f["num_draft_tokens"] == 5 and f["error"].startswith("AssertionError(")


def test_mimo_v2_vllm_writes_n_predict_1_and_reads_layer_0_only(tmp_path):
    d = _folder(tmp_path, "m2", MIMO_V2)
    rep = check_mtp(d, d, spec=MTPSpec(), rules=VLLMMTPRules())
    loads = rep.draft_checks["facts"]["loads"]
    assert rep.findings == [] and loads["n_predict"] == 1 and loads["prefixes"] == ["model.mtp.layers.0."]
    assert rep.draft_checks["facts"]["settings"]["num_steps"] == 1
    f = _one(check_mtp(d, d, spec=MTPSpec(num_steps=3), rules=VLLMMTPRules()), "mtp_steps_beyond_head")["evidence"]
    assert (f["num_steps"], f["head_layers"]) == (3, 1) and "mimo_v2_mtp.py" in f["source"]
    # the field absent (MiMoV2FlashConfig has none): vLLM still writes n_predict 1, no refusal
    absent = _folder(tmp_path, "absent", MIMO_V2, num_nextn_predict_layers=None)
    assert check_mtp(absent, absent, spec=MTPSpec(), rules=VLLMMTPRules()).findings == []


def test_diagnose_cli_for_longcat_on_vllm_and_the_offline_head_refusal(tmp_path, capsys):
    two = _folder(tmp_path, "two", LONGCAT, num_nextn_predict_layers=2)
    cfg = str(two / "config.json")
    assert main(["diagnose", "--draft-config", cfg, "--target-config", cfg, "--engine", "vllm", "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert [f["kind"] for f in doc["findings"]] == ["mtp_steps_beyond_head"]
    assert doc["draft_checks"]["facts"]["loads"]["prefixes"] == ["model.mtp.layers.0."]
    with pytest.raises(BadInput, match="longcat_flash MTP head .*offline head is built for deepseek_v3, mimo only"):
        load_draft(two, two)


def _att(folder: Path, layers, multi_layer=False) -> SimpleNamespace:
    return SimpleNamespace(draft_dir=folder, draft_head={"family": "x", "layers": layers},
                           info={"enable_multi_layer_eagle": multi_layer})


@pytest.mark.parametrize("src,edit,declared,vllm", [
    (MTP / "mimo-7b_shape.json", lambda c: c.update(num_nextn_predict_layers=3), 3, 3),
    (MTP / "qwen3.5-27b_shape.json", lambda c: c["text_config"].update(mtp_num_hidden_layers=2), 2, 2),
    (None, None, 3, 1),                                          # MiMo-V2: vLLM builds one layer too
])
def test_the_live_path_checks_steps_against_the_layers_the_engine_builds(tmp_path, src, edit, declared, vllm):
    cfg = json.loads(src.read_text()) if src else dict(MIMO_V2)
    if edit:
        edit(cfg)
    d = _folder(tmp_path, "d", cfg)
    att = _att(d, declared)
    assert head_depth(att, MTPRules()) == 1 and att.draft_head["layers_built"] == 1     # SGLang builds one
    # 2 served steps: beyond the one SGLang layer, within the declared count (what the live path used to take)
    assert steps_check(2, head_depth(att, MTPRules()), None)["trained_steps"] == 1
    assert steps_check(2, declared, None) is None
    assert head_depth(_att(d, declared), VLLMMTPRules()) == vllm
    assert head_depth(SimpleNamespace(draft_dir=None, draft_head={"layers": 5}), MTPRules()) == 5


def test_the_live_path_reads_multi_layer_eagle_from_server_info_for_mimo_v2(tmp_path):
    """/server_info's resolved enable_multi_layer_eagle decides MiMo-V2's SGLang depth: on (or not reported), one
    draft model per step over the 3 declared layers; off (NEXTN), the one folded layer."""
    d = _folder(tmp_path, "d", dict(MIMO_V2))
    assert head_depth(_att(d, 3, multi_layer=True), MTPRules()) == 3
    assert head_depth(SimpleNamespace(draft_dir=d, draft_head={"layers": 3}, info={}), MTPRules()) == 3
    assert head_depth(_att(d, 3, multi_layer=False), MTPRules()) == 1
    assert head_depth(_att(d, 3, multi_layer=True), VLLMMTPRules()) == 1      # vLLM builds one whatever


def test_the_budget_line_is_provisional_until_the_engine_state_probes_join():
    lines: list[str] = []
    r = SimpleNamespace(att=SimpleNamespace(spec={"num_steps": 3}),
                        req=SimpleNamespace(live_measure=True, engine_probes="cheap"),
                        progress=lines.append, doc=SimpleNamespace(notes=[]))
    first = budget_line(r, "NextN accept length (3x1): wiring 2.10. Cause: none.")
    assert first.startswith(f"[{PROVISIONAL}] ") and first.endswith("Cause: none.")
    final_budget_line(r, {"sentence": "NextN accept length (3x1): wiring 2.10. Cause: engine.", "cause": "engine"})
    final_budget_line(r, None)
    assert lines == ["acceptance budget (final, engine-state probes joined): NextN accept length (3x1): wiring 2.10. "
                     "Cause: engine."]
    # no probes will run (--no-measure): the first line is the final one, unmarked, and run_engine_state agrees
    r.req.live_measure = False
    assert budget_line(r, "Cause: none.") == "Cause: none."
    assert run_engine_state(r) is None and r.doc.notes == ["engine-state probes not run: --no-measure (no live requests)"]



def test_engine_probes_none_leaves_the_first_budget_line_final():
    """``--engine-probes none`` (the one value of helpers.investigation.probes.CHOICES that asks for no probe): the
    budget line was marked provisional, then "final, engine-state probes joined" printed though no probe ran. Now
    the first line is unmarked and no second line follows; cheap / all still mark it and print the joined one."""
    from helpers.investigation.probes import CHOICES, asks_none
    assert [c for c in CHOICES if asks_none(c)] == ["none"]
    for which, joins in (("none", False), ("cheap", True), ("all", True)):
        lines: list[str] = []
        r = SimpleNamespace(att=SimpleNamespace(spec={"num_steps": 3}),
                            req=SimpleNamespace(live_measure=True, engine_probes=which), progress=lines.append)
        first = budget_line(r, "Cause: none.")
        final_budget_line(r, {"sentence": "Cause: none.", "cause": "none"})
        assert first.startswith(f"[{PROVISIONAL}] ") is joins, (which, first)
        assert lines == (["acceptance budget (final, engine-state probes joined): Cause: none."] if joins else []), \
            (which, lines)
