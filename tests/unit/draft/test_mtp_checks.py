"""MTP / NextN heads (issue 37 part 5): recognised as one draft family (helpers/layers/mtp.py), never
``unsupported_draft``; the config-only checks (``diagnose --draft-config D --target-config T``,
helpers/draft/mtp_checks.py) say what SGLang 0.5.23 and vLLM 0.32.0 load and from where, their refusals, steps past
the head's layers and the draft-token override; ``investigate`` against an MTP server (a fake SGLang answering as
a NEXTN server does, by SGLang's code) attaches, says what the draft is and stops with one line, exit 2.

Configs: the public DeepSeek-V3, Kimi-K2.5 and Qwen3-Next configs (tests/data/public_configs/aiconfigurator/), GLM-4.5,
MiMo and a separate NextN checkpoint as shapes (tests/data/mtp_configs/README.md); tensor names from a written
safetensors index and from the reference Kimi-class target's real safetensors headers."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from helpers.__main__ import main
from helpers.diagnosis.detectors import detect_unsupported_draft
from helpers.draft.config_checks import check_configs
from helpers.draft.mtp_checks import MTPSpec, check_mtp
from helpers.engines.vllm_rules import VLLMMTPRules
from helpers.errors import BadInput
from helpers.formats.configs import read_draft_config
from helpers.layers.mtp import MTP_FAMILIES, deepseek_nextn_shapes, mtp_head
from support import DATA

PUB = DATA / "public_configs" / "aiconfigurator"
MTP = DATA / "mtp_configs"
REPO = Path(__file__).resolve().parents[3]
KIMI_TARGET = REPO / "env" / "models" / "kimi" / "target"
SGLANG_PY = REPO / "env" / "reference" / ".venv" / "bin" / "python"
#: config file, family, SGLang's head class, SGLang's prefix, vLLM's first prefix
FAMILIES = [
    (PUB / "deepseek-ai--DeepSeek-V3_config.json", "deepseek_v3", "DeepseekV3ForCausalLMNextN", "model.layers.61.",
     "model.layers.61."),
    (MTP / "glm-4.5_shape.json", "glm4_moe", "Glm4MoeForCausalLMNextN", "model.layers.92.", "model.layers.92."),
    (MTP / "glm-4.7-flash_shape.json", "glm4_moe_lite", "Glm4MoeLiteForCausalLMNextN", "model.layers.47.",
     "model.layers.47."),
    (MTP / "qwen3.5-27b_shape.json", "qwen3_5", "Qwen3_5ForCausalLMMTP", "mtp.", "mtp."),
    (PUB / "Qwen--Qwen3-Next-80B-A3B-Thinking_config.json", "qwen3_next", "Qwen3NextForCausalLMMTP", "mtp.", "mtp."),
    (MTP / "mimo-7b_shape.json", "mimo", "MiMoMTP", "model.mtp_layers.0.", "model.mtp_layers.0."),
    (MTP / "deepseek-v3-nextn-checkpoint_shape.json", "deepseek_v3", "DeepseekV3ForCausalLMNextN", "model.layers.0.",
     "model.layers.1."),
]


def folder(tmp: Path, src: Path, name: str, edit=None, index: list[str] | None = None) -> Path:
    """``src`` as ``tmp/name/config.json`` (``edit(cfg)`` changes it), with a ``model.safetensors.index.json`` naming
    ``index`` when given (the shards are not there: only the names are read)."""
    d = tmp / name
    d.mkdir(parents=True)
    cfg = json.loads(src.read_text())
    if edit is not None:
        edit(cfg)
    (d / "config.json").write_text(json.dumps(cfg))
    if index is not None:
        (d / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {}, "weight_map": {k: "model-00001-of-00002.safetensors" for k in index}}))
    return d


def kinds(rep) -> list[str]:
    return [f["kind"] for f in rep.findings]


def one(rep, kind: str) -> dict:
    fs = [f for f in rep.findings if f["kind"] == kind]
    assert len(fs) == 1, rep.findings
    return fs[0]


@pytest.mark.parametrize("src,family,cls,sg_prefix,vl_prefix", FAMILIES, ids=[f[1] + "-" + f[0].stem for f in FAMILIES])
def test_each_family_is_an_mtp_head_with_its_class_and_prefix_never_unsupported_draft(tmp_path, src, family, cls,
                                                                                      sg_prefix, vl_prefix):
    d = read_draft_config(src)
    assert d.form == "mtp" and not d.is_eagle3 and detect_unsupported_draft(d) == []
    head = mtp_head(json.loads(src.read_text()))
    assert head.family.name == family and head.family.head_arch == cls
    # the target itself as the draft (no draft path), steps 1: the engine loads the head and nothing is wrong
    rep = check_configs(src, src, spec=MTPSpec(num_steps=1, topk=1))
    assert rep.verdict == "ok" and rep.findings == [], rep.findings
    loads = rep.draft_checks["facts"]["loads"]
    assert loads["class"] == cls and loads["prefixes"] == [sg_prefix]
    algo = rep.draft_checks["facts"]["algorithm"]
    assert (algo["requested"], algo["as_run"]) == (None, "EAGLE") and "NEXTN -> EAGLE" in algo["rule"]
    v = check_mtp(src, src, spec=MTPSpec(num_steps=1), rules=VLLMMTPRules())
    assert v.findings == [] and v.draft_checks["facts"]["loads"]["prefixes"][0] == vl_prefix
    # the same target served as an EAGLE-3 draft: the head is refused by name, not reported as an unknown draft
    rep = check_configs(src, src, algorithm="EAGLE3")
    assert kinds(rep) == ["mtp_head_refused"] and "NEXTN" in one(rep, "mtp_head_refused")["evidence"]["fix"]


def test_draft_path_default_and_fallback_follow_the_family():
    ds = check_configs(PUB / "deepseek-ai--DeepSeek-V3_config.json", PUB / "deepseek-ai--DeepSeek-V3_config.json")
    qn = check_configs(PUB / "Qwen--Qwen3-Next-80B-A3B-Thinking_config.json",
                       PUB / "Qwen--Qwen3-Next-80B-A3B-Thinking_config.json")
    assert "_handle_eagle_family" in ds.draft_checks["facts"]["loads"]["draft_path"]
    assert "stays null" in qn.draft_checks["facts"]["loads"]["draft_path"]
    # Qwen3-Next's config has no num_nextn_predict_layers: SGLang sets it to 1 for the draft, vLLM leaves n_predict
    # None, so vLLM needs num_speculative_tokens
    assert "num_nextn_predict_layers = 1" in qn.draft_checks["facts"]["loads"]["rewrite"]
    v = check_mtp(PUB / "Qwen--Qwen3-Next-80B-A3B-Thinking_config.json",
                  PUB / "Qwen--Qwen3-Next-80B-A3B-Thinking_config.json", rules=VLLMMTPRules())
    f = one(v, "mtp_head_refused")
    assert "num_speculative_tokens` was not provided" in f["detail"]
    assert f["evidence"]["source"].endswith("l. 1503-1507")


def test_refusals_of_sglang_and_vllm(tmp_path):
    ds = PUB / "deepseek-ai--DeepSeek-V3_config.json"
    # the field left out: DeepseekV3Config's default 1 applies (SGLang's loader raises ValueError only for a config
    # class without the field), so the head loads
    absent = folder(tmp_path, ds, "absent", edit=lambda c: c.pop("num_nextn_predict_layers"))
    rep = check_configs(absent, absent, spec=MTPSpec(num_steps=1, topk=1))
    assert rep.findings == [] and rep.draft_checks["facts"]["head"]["layers_defaulted"] is True
    assert any("config class's default 1" in n for n in rep.advisories)
    two = folder(tmp_path, ds, "two", edit=lambda c: c.update(num_nextn_predict_layers=2))
    f = one(check_configs(two, two), "mtp_head_refused")
    assert "Only 1 nextn layer is supported" in f["detail"] and f["evidence"]["value"] == 2
    # vLLM takes two layers, but 3 tokens are no multiple of n_predict 2; 4 are (two rounds over both layers)
    v = check_mtp(two, two, spec=MTPSpec(num_steps=3), rules=VLLMMTPRules())
    assert kinds(v) == ["mtp_head_refused"] and "must be divisible by n_predict=2" in v.findings[0]["detail"]
    v = check_mtp(two, two, spec=MTPSpec(num_steps=4), rules=VLLMMTPRules())
    assert kinds(v) == ["mtp_steps_beyond_head"] and v.findings[0]["evidence"]["head_layers"] == 2
    # Kimi-K2.5: a wrapper whose text config is DeepSeek-V3 with no NextN layer; SGLang rewrites architectures[0] only
    kimi = PUB / "moonshotai--Kimi-K2.5_config.json"
    rep = check_configs(kimi, kimi, algorithm="NEXTN")
    f = one(rep, "mtp_head_refused")
    assert "KimiK25ForConditionalGeneration" in f["detail"] and "DeepseekV3ForCausalLM is one" in f["detail"]
    # a Kimi-K2.5-like target whose text config is rewritten as the wrapper would be: no layer to serve
    zero = folder(tmp_path, ds, "zero", edit=lambda c: c.update(num_nextn_predict_layers=0))
    f = one(check_configs(zero, zero), "mtp_head_refused")
    assert "ships no MTP head" in f["detail"]
    assert kinds(check_mtp(zero, zero, rules=VLLMMTPRules())) == ["mtp_head_refused"]


def test_steps_beyond_the_head_and_the_draft_token_override():
    ds = PUB / "deepseek-ai--DeepSeek-V3_config.json"
    rep = check_configs(ds, ds)                        # nothing given: SGLang auto-chooses (3, 1, 4) for DeepSeek
    f = one(rep, "mtp_steps_beyond_head")
    assert (f["evidence"]["num_steps"], f["evidence"]["head_layers"]) == (3, 1)
    assert "draft_forward" in f["evidence"]["source"] and "--speculative-num-steps 1" in f["evidence"]["fix"]
    assert any("_auto_choose_speculative_params" in n for n in rep.advisories)
    rep = check_configs(ds, ds, spec=MTPSpec("NEXTN", 2, 1, 2))
    assert kinds(rep) == ["mtp_steps_beyond_head", "num_draft_tokens_overridden"]
    assert one(rep, "num_draft_tokens_overridden")["evidence"]["effective"] == 3
    assert rep.draft_checks["facts"]["settings"]["num_draft_tokens"] == 3
    rep = check_configs(ds, ds, spec=MTPSpec("NEXTN", 1, 1, 2))
    assert kinds(rep) == []
    with pytest.raises(BadInput, match="speculative-num-steps"):
        check_configs(ds, ds, spec=MTPSpec(num_steps=2))


def test_the_heads_tensors_from_an_index_without_weights_and_from_real_headers(tmp_path):
    ds = PUB / "deepseek-ai--DeepSeek-V3_config.json"
    # every tensor of DeepSeek-V3's layer 61 (MLA, 256 experts, the shared expert) as the config implies
    full = list(deepseek_nextn_shapes(json.loads(ds.read_text()))) + ["model.embed_tokens.weight"]
    assert len(full) == 3 * 256 + 3 + 7 + 4 + 2 + 2 + 1
    ok = folder(tmp_path, ds, "ok", index=full)
    rep = check_configs(ok, ok, spec=MTPSpec(num_steps=1, topk=1))
    assert rep.findings == [] and rep.draft_checks["facts"]["head_weights"]["missing"] == {}
    cut = folder(tmp_path, ds, "cut", index=[k for k in full if "eh_proj" not in k])
    f = one(check_configs(cut, cut, spec=MTPSpec(num_steps=1, topk=1)), "mtp_weights_missing")
    assert f["evidence"]["missing"] == {"model.layers.61.": ["model.layers.61.eh_proj.weight"]}
    assert "keep their initial values" in f["detail"] and "eh_proj -> torch's nn.Linear random init" in f["detail"]
    # a quantised layer stores its experts as qweight / scales: the module is there
    q = folder(tmp_path, ds, "q", index=[k.replace("gate_proj.weight", "gate_proj.qweight") for k in full])
    assert check_configs(q, q, spec=MTPSpec(num_steps=1, topk=1)).findings == []
    # some experts left out of a full index: each one named, served from uninitialised memory
    few = folder(tmp_path, ds, "few", index=[k for k in full if ".experts.7." not in k and ".experts.200." not in k])
    f = one(check_configs(few, few, spec=MTPSpec(num_steps=1, topk=1)), "mtp_weights_missing")
    assert len(f["evidence"]["missing"]["model.layers.61."]) == 6
    assert "uninitialised memory (torch.empty)" in f["detail"]
    v = one(check_mtp(cut, cut, spec=MTPSpec(num_steps=1), rules=VLLMMTPRules()), "mtp_weights_missing")
    assert "Following weights were not initialized" in v["detail"]
    # a separate NextN checkpoint (num_hidden_layers 1): SGLang reads model.layers.0.*, vLLM model.layers.1.*
    nextn = MTP / "deepseek-v3-nextn-checkpoint_shape.json"
    sep = folder(tmp_path, nextn, "sep", index=[k.replace(".61.", ".0.") for k in full])
    assert check_configs(sep, ds, spec=MTPSpec(num_steps=1, topk=1)).findings == []
    v = one(check_mtp(sep, ds, spec=MTPSpec(num_steps=1), rules=VLLMMTPRules()), "mtp_weights_missing")
    assert list(v["evidence"]["missing"]) == ["model.layers.1."]
    # the reference Kimi-class target carries its trained NextN layer (model.layers.8.*): nothing missing in its real
    # safetensors headers; the same target with that layer left out (real headers, written here) is named
    rep = check_configs(KIMI_TARGET, KIMI_TARGET, spec=MTPSpec(num_steps=1, topk=1))
    assert rep.findings == [], rep.findings
    from safetensors import safe_open
    from safetensors.torch import save_file
    with safe_open(str(KIMI_TARGET / "model.safetensors"), "pt") as fh:
        kept = {k: fh.get_tensor(k) for k in fh.keys() if not k.startswith("model.layers.8.")}
    cut8 = tmp_path / "kimi-no-head"
    cut8.mkdir()
    (cut8 / "config.json").write_text((KIMI_TARGET / "config.json").read_text())
    save_file(kept, str(cut8 / "model.safetensors"))
    f = one(check_configs(cut8, cut8, spec=MTPSpec(num_steps=1, topk=1)), "mtp_weights_missing")
    assert list(f["evidence"]["missing"]) == ["model.layers.8."] and f["evidence"]["tensors_in_checkpoint"] > 50


def test_the_registry_is_one_entry_per_family():
    archs = [a for f in MTP_FAMILIES for a in (*f.target_archs, f.head_arch)]
    assert len(archs) == len(set(archs)) and len({f.name for f in MTP_FAMILIES}) == len(MTP_FAMILIES)
    lib = REPO / "env" / "reference" / ".venv" / "lib"
    assert all(any(lib.glob(f"python3*/site-packages/{f.head_file}")) for f in MTP_FAMILIES)


def test_diagnose_cli_and_investigate_against_an_mtp_server(tmp_path, capsys):
    from support.fakeserver import fake_server
    ds = PUB / "deepseek-ai--DeepSeek-V3_config.json"
    assert main(["diagnose", "--draft-config", str(ds), "--target-config", str(ds), "--speculative-num-steps", "3",
                 "--speculative-eagle-topk", "1", "--engine", "vllm", "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert [f["kind"] for f in doc["findings"]] == ["mtp_steps_beyond_head"]
    assert doc["draft_checks"]["facts"]["loads"]["class"] == "DeepSeekMTPModel"
    # investigate: the fake server answers /server_info as SGLang 0.5.23 does for --speculative-algorithm NEXTN on a
    # DeepSeek-class target (tests/support/fakeserver.py NEXTN_INFO)
    target = tmp_path / "target"
    target.mkdir()
    shutil.copy(KIMI_TARGET / "config.json", target / "config.json")
    with fake_server("nextn", "--model-path", str(target)) as url:
        rc = main(["investigate", "--url", url, "--training", str(REPO / "env" / "models" / "kimi" / "data" / "sample"),
                   "--out", str(tmp_path / "runs")])
        err = capsys.readouterr().err.strip().splitlines()[-1]
        # --check-draft replays the head's proposals (its offline head, helpers.draft.nextn): this server runs no
        # draft step trace, so both probes are skipped saying how to start one, and the check is undecided (exit 3)
        rc2 = main(["investigate", "--url", url, "--check-draft", "--out", str(tmp_path / "checks")])
        out2 = capsys.readouterr()
        check = json.loads(next((tmp_path / "checks").glob("*/check_draft.json")).read_text())
    # investigate runs a DeepSeek-V3 NextN head (helpers.investigation.mtp): past the attach, the fake server's
    # 48-wide hidden states are refused as no state of a 128-wide target; --check-draft still stops at the attach
    assert rc == 2 and rc2 == 3, out2
    assert "the served hidden states are [48] wide, the target's hidden size is 128" in err
    assert check["verdict"] == "undecided" and check["attach"]["draft_head"]["class"] == "DeepseekV3ForCausalLMNextN"
    assert [(p["probe"], p["status"]) for p in check["engine_state"]["probes"]] == \
        [("served_draft", "skipped"), ("step_trace", "skipped")], check["engine_state"]
    assert all("--trace-draft" in p["why"] for p in check["engine_state"]["probes"]), check["engine_state"]
    doc = json.loads(next((tmp_path / "runs").glob("*/investigation.json")).read_text())
    head = doc["attach"]["draft_head"]
    assert head["class"] == "DeepseekV3ForCausalLMNextN" and "model.layers.8." in head["source"]
    s = head["spec"]
    assert (s["algorithm_requested"], s["algorithm_as_run"], s["num_steps"], s["topk"], s["num_draft_tokens"]) == \
        ("NEXTN", "EAGLE", 3, 1, 4)
    assert [o["finding"] for o in s["overrides"] if o["kind"] == "forced"] == ["num_draft_tokens_overridden"]
    assert doc["error"] and doc["findings"] == []


@pytest.mark.skipif(not SGLANG_PY.exists(), reason="env/reference/.venv (sglang 0.5.23) not installed")
def test_sglang_builds_the_head_the_checks_name(tmp_path):
    """One SGLang process reads each config as the draft (tests/support/sglang_mtp_configs.py: ModelConfig with
    is_draft_model, and the DeepSeek / GLM loader's _initialize_nextn_conf): the head class, the layer count, the
    checkpoint prefix or the refusal agree with the checks'."""
    ds = PUB / "deepseek-ai--DeepSeek-V3_config.json"
    cases = {"ds": (ds, None), "ds_absent": (ds, lambda c: c.pop("num_nextn_predict_layers")),
             "ds_two": (ds, lambda c: c.update(num_nextn_predict_layers=2)), "glm": (MTP / "glm-4.5_shape.json", None),
             "qwen": (PUB / "Qwen--Qwen3-Next-80B-A3B-Thinking_config.json", None),
             "nextn": (MTP / "deepseek-v3-nextn-checkpoint_shape.json", None),
             "glm_lite": (MTP / "glm-4.7-flash_shape.json", None),
             "glm_lite_two": (MTP / "glm-4.7-flash_shape.json", lambda c: c.update(num_nextn_predict_layers=2)),
             "qwen35": (MTP / "qwen3.5-27b_shape.json", None),
             "longcat_two": (MTP / "longcat-flash_defaults.json", lambda c: c.update(num_nextn_predict_layers=2)),
             "mimo_v2": (MTP / "mimo-v2-flash_defaults.json", None),
             "step3p5": (MTP / "step-3.5-flash_defaults.json", None),
             "ernie": (MTP / "ernie-4.5-moe_defaults.json", None),
             "qwen3_moe": (MTP / "qwen3-moe-mtp_defaults.json", lambda c: c.update(num_nextn_predict_layers=2))}
    folders = {}
    for name, (src, edit) in cases.items():
        def strip(c, edit=edit):          # the fp8 quantization block needs CUDA kernels to be read by SGLang
            c.pop("quantization_config", None)
            if edit is not None:
                edit(c)
        folders[name] = folder(tmp_path, src, name, edit=strip)
    (tmp_path / "jobs.json").write_text(json.dumps([{"name": n, "folder": str(f)} for n, f in folders.items()]))
    env = {**os.environ, "SGLANG_USE_CPU_ENGINE": "1"}
    proc = subprocess.run([str(SGLANG_PY), str(REPO / "tests" / "support" / "sglang_mtp_configs.py"),
                           str(tmp_path / "jobs.json"), str(tmp_path / "out.json")], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    sg = json.loads((tmp_path / "out.json").read_text())
    for name, f in folders.items():
        # Step-3.5 loads only with multi-layer EAGLE (--speculative-algorithm EAGLE); NEXTN is checked below
        rep = check_configs(f, f, spec=MTPSpec("EAGLE" if name == "step3p5" else None, num_steps=1, topk=1))
        loads = rep.draft_checks["facts"]["loads"]
        assert sg[name]["head_class"] == loads["class"], name
        refused = [x for x in rep.findings if x["kind"] == "mtp_head_refused"]
        if "refused" in sg[name]:
            assert len(refused) == 1 and refused[0]["evidence"]["error"].startswith(
                sg[name]["refused"].split(":")[0]) and sg[name]["refused"].split(": ", 1)[1] in refused[0]["detail"]
        else:
            # Qwen3-Next and MiMo-V2: the rewrite writes num_nextn_predict_layers = 1 whatever is declared
            assert refused == [] and sg[name]["layers"] == (
                loads["layers_declared"] if name not in ("qwen", "mimo_v2", "qwen3_moe") else 1), name
            if "prefix" in sg[name]:
                assert loads["prefixes"] == [sg[name]["prefix"]], name
    assert sg["ds_two"]["refused"] == "AssertionError: Only 1 nextn layer is supported"
    assert sg["nextn"]["prefix"] == "model.layers.0." and sg["qwen"]["layers"] == 1
    assert sg["glm_lite"]["prefix"] == "model.layers.47." and sg["glm_lite_two"]["refused"].startswith("AssertionError")
    assert sg["qwen35"]["head_class"] == "Qwen3_5ForCausalLMMTP" and sg["qwen35"]["layers"] == 1
    assert sg["longcat_two"] == {"head_class": "LongcatFlashForCausalLMNextN", "layers": 2}
    assert sg["mimo_v2"] == {"head_class": "MiMoV2MTP", "layers": 1, "step1_reads": ["model.mtp.layers.0.enorm.weight"]}
    # with NEXTN Step-3.5's one head model has no draft index: SGLang's own load_weights raises what the check names
    nextn = [x for x in check_configs(folders["step3p5"], folders["step3p5"], spec=MTPSpec("NEXTN", 1, 1, 2)).findings
             if x["kind"] == "mtp_head_refused"]
    assert len(nextn) == 1 and sg["step3p5"]["single_layer_load"].startswith("TypeError: unsupported operand")
    raised = sg["step3p5"]["single_layer_load"].split(": ", 1)[1]
    assert nextn[0]["evidence"]["error"] == f'TypeError("{raised}")'
    assert (sg["step3p5"]["head_class"], sg["step3p5"]["layers"]) == ("Step3p5MTP", 3)
    assert sg["ernie"] == {"head_class": "Ernie4_5_MoeForCausalLMMTP", "layers": 1}
    assert sg["qwen3_moe"] == {"head_class": "Qwen3MoeForCausalLMMTP", "layers": 1}      # 2 declared, 1 written


def test_the_draft_cost_leaves_the_targets_nextn_layer_out():
    """The Kimi target's NextN layer (model.layers.8.*) is not read by its verify forward: the draft cost's target
    parameters are those of layers 0-7 and the rest (with it counted, the settings stage recommended other steps)."""
    from helpers.draft.cost import _beyond_last_layer, _num_layers, _parameter_counts, draft_cost
    counts = _parameter_counts(KIMI_TARGET)
    head = sum(n for k, n in counts.items() if k.startswith("model.layers.8."))
    n = _num_layers(KIMI_TARGET)
    assert n == 8 and head > 0 and all(_beyond_last_layer(k, n) == k.startswith("model.layers.8.") for k in counts)
    cost, how = draft_cost(REPO / "env" / "models" / "kimi" / "draft", KIMI_TARGET)
    assert f"target {(sum(counts.values()) - head) / 1e6:.2f} M" in how


# ---------------------------------------------------------------- bad MTP fields: exit 2, one line naming the field

def _ds_folder(tmp: Path, name: str, **fields) -> Path:
    """The public DeepSeek-V3 config with ``fields`` set (a value ``...``: the field removed)."""
    def edit(cfg):
        for k, v in fields.items():
            if v is ...:
                cfg.pop(k, None)
            else:
                cfg[k] = v
    return folder(tmp, PUB / "deepseek-ai--DeepSeek-V3_config.json", name, edit)


@pytest.mark.parametrize("field,value", [
    ("num_nextn_predict_layers", "1"), ("num_nextn_predict_layers", None), ("num_nextn_predict_layers", 1.5),
    ("num_nextn_predict_layers", [1]), ("num_nextn_predict_layers", True), ("num_nextn_predict_layers", -1),
    ("num_nextn_predict_layers", 65), ("num_hidden_layers", "8"), ("num_hidden_layers", -3)])
@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_a_present_mtp_field_of_the_wrong_type_or_range_is_exit_2_naming_it(tmp_path, capsys, field, value, engine):
    """A present field of the wrong type or range is refused (before: taken as absent, 'default 1 applies', exit 0);
    the message names the file and the field, on one line."""
    d = _ds_folder(tmp_path, "t", **{field: value})
    rc = main(["diagnose", "--draft-config", str(d), "--target-config", str(d), "--engine", engine])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert f"[{field}]" in err and str(d / "config.json") in err and "expected" in err, err


def test_only_an_absent_layer_field_gets_the_config_class_default(tmp_path):
    absent = check_mtp(_ds_folder(tmp_path, "a", num_nextn_predict_layers=...),
                       _ds_folder(tmp_path, "b", num_nextn_predict_layers=...), rules=VLLMMTPRules())
    assert absent.draft_checks["facts"]["head"]["layers_defaulted"] is True
    assert any("not in the config: the config class's default 1" in n for n in absent.advisories)
    given = check_mtp(_ds_folder(tmp_path, "c", num_nextn_predict_layers=1),
                      _ds_folder(tmp_path, "d", num_nextn_predict_layers=1), rules=VLLMMTPRules())
    assert given.draft_checks["facts"]["head"]["layers_defaulted"] is False
    assert not any("not in the config" in n for n in given.advisories)


def test_an_absurd_head_layer_count_is_refused_in_bounded_time_and_memory(tmp_path, capsys):
    """10**12 head layers with --engine vllm (before: one prefix per layer, memory without bound): refused at once,
    naming the field; the head object itself never lists more than MAX_MTP_LAYERS prefixes."""
    import time
    import tracemalloc

    from helpers.layers.mtp import MAX_MTP_LAYERS
    d = _ds_folder(tmp_path, "t", num_nextn_predict_layers=10 ** 12)
    tracemalloc.start()
    t0 = time.perf_counter()
    rc = main(["diagnose", "--draft-config", str(d), "--target-config", str(d), "--engine", "vllm"])
    took = time.perf_counter() - t0
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    err = capsys.readouterr().err
    assert rc == 2 and "[num_nextn_predict_layers]" in err and f"0-{MAX_MTP_LAYERS}" in err, err
    assert took < 1.0 and peak < 20 * 2 ** 20, (took, peak)
    head = mtp_head(json.loads((d / "config.json").read_text()))
    with pytest.raises(ValueError, match="over 64"):
        head.vllm_prefixes()
    ok = mtp_head({**json.loads((d / "config.json").read_text()), "num_nextn_predict_layers": MAX_MTP_LAYERS})
    assert len(ok.vllm_prefixes()) == MAX_MTP_LAYERS and ok.vllm_prefixes()[-1] == "model.layers.124."


@pytest.mark.parametrize("argv,flag", [
    (["--speculative-num-steps", "1000000000", "--speculative-eagle-topk", "1"], "--speculative-num-steps"),
    (["--speculative-num-steps", "2", "--speculative-eagle-topk", "1000000"], "--speculative-eagle-topk"),
    (["--speculative-num-steps", "65", "--speculative-eagle-topk", "1"], "--speculative-num-steps")])
def test_speculative_counts_past_the_protocol_bounds_are_exit_2(tmp_path, capsys, argv, flag):
    d = _ds_folder(tmp_path, "t")
    rc = main(["diagnose", "--draft-config", str(d), "--target-config", str(d), *argv])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and f"[{flag}]" in err and "1-64" in err, err
    rc = main(["diagnose", "--draft-config", str(d), "--target-config", str(d), "--speculative-num-steps", "64",
               "--speculative-eagle-topk", "1"])
    assert rc == 1, capsys.readouterr()          # 64 steps with one head layer: mtp_steps_beyond_head, not refused
