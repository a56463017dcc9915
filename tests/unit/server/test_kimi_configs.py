"""A DeepSeek-family config SGLang 0.5.23 would refuse on the CPU reference server is refused before anything is
launched, with one line naming the file and the field (helpers.server.embedded.check_cpu_config). No server: the
check runs before the launch, so a config.json is all a folder needs."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.errors import BadServerInput
from helpers.server.embedded import check_cpu_config, start
from support import ROOT
from support.kimi import KIMI_SHAPE, SGLANG_KEYS, yarn_rope


def _target_cfg(**changes) -> dict:
    cfg = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", **KIMI_SHAPE, **SGLANG_KEYS,
           "rope_parameters": yarn_rope(512), "rope_interleave": True}
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    return cfg


def _mla_draft_cfg(**changes) -> dict:
    cfg = {"architectures": ["Eagle3DeepseekV2ForCausalLM"], "model_type": "deepseek_v3", "num_hidden_layers": 1,
           "hidden_size": 128, "q_lora_rank": 64, "kv_lora_rank": 64, "rope_parameters": yarn_rope(512),
           "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 4]}}
    cfg.update(changes)
    return cfg


def _folder(tmp_path: Path, name: str, cfg: dict) -> Path:
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.mark.parametrize("changes,field", [
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}, "rope_parameters.rope_type"),
    ({"rope_parameters": None}, "rope_parameters.rope_type"),
    ({"rope_parameters": None, "rope_scaling": {"type": "default"}}, "rope_scaling.type"),
    ({"moe_layer_freq": None}, "moe_layer_freq"),
    ({"topk_method": None}, "topk_method"),
])
def test_target_configs_sglang_refuses_on_cpu_name_file_and_field(tmp_path, changes, field):
    d = _folder(tmp_path, "t", _target_cfg(**changes))
    with pytest.raises(BadServerInput) as exc:
        check_cpu_config(json.loads((d / "config.json").read_text()), d, "target")
    msg = str(exc.value)
    assert "\n" not in msg and str(d / "config.json") in msg and f"field {field}:" in msg


def test_kimi_k25_text_config_is_the_one_checked(tmp_path):
    wrapper = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
               "text_config": _target_cfg(rope_parameters={"rope_type": "default"})}
    with pytest.raises(BadServerInput, match=r"field text_config\.rope_parameters\.rope_type: is 'default'"):
        check_cpu_config(wrapper, tmp_path, "target")
    wrapper["text_config"] = _target_cfg()
    check_cpu_config(wrapper, tmp_path, "target")


@pytest.mark.parametrize("changes,field", [({"q_lora_rank": None}, "q_lora_rank"),
                                           ({"num_hidden_layers": 2}, "num_hidden_layers"),
                                           ({"rope_parameters": {"rope_type": "default"}}, "rope_parameters.rope_type")])
def test_mla_draft_configs_sglang_refuses_name_file_and_field(tmp_path, changes, field):
    d = _folder(tmp_path, "d", _mla_draft_cfg(**changes))
    with pytest.raises(BadServerInput, match=rf"draft config {d / 'config.json'}: field {field}:"):
        check_cpu_config(json.loads((d / "config.json").read_text()), d, "draft")


def test_good_and_other_family_configs_pass(tmp_path):
    check_cpu_config(_target_cfg(), tmp_path, "target")
    check_cpu_config(_mla_draft_cfg(), tmp_path, "draft")
    # not the DeepSeek family: its RoPE is not SGLang's deepseek_yarn path, nothing to check here
    check_cpu_config({"architectures": ["LlamaForCausalLM"], "rope_parameters": {"rope_type": "default"}},
                     tmp_path, "target")
    check_cpu_config({"architectures": ["LlamaForCausalLMEagle3"], "num_hidden_layers": 1}, tmp_path, "draft")


def test_start_refuses_before_launching(tmp_path):
    """embedded.start raises on the config before it looks for the SGLang interpreter or a port."""
    bad = _folder(tmp_path, "t", _target_cfg(topk_method=None))
    with pytest.raises(BadServerInput, match="field topk_method"):
        start(bad, None, tp=1, python=tmp_path / "no-such-python")
    good = _folder(tmp_path, "t2", _target_cfg())
    draft = _folder(tmp_path, "d", _mla_draft_cfg(q_lora_rank=None))
    with pytest.raises(BadServerInput, match="field q_lora_rank"):
        start(good, draft, tp=1, python=tmp_path / "no-such-python")


def test_server_start_cli_prints_one_line_and_exits_2(tmp_path):
    bad = _folder(tmp_path, "t", _target_cfg(rope_parameters={"rope_type": "default", "rope_theta": 1e4}))
    r = subprocess.run([sys.executable, "-m", "helpers", "server", "start", "--target", str(bad), "--tp", "2"],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("server: error: target config ")
    assert "field rope_parameters.rope_type: is 'default'" in lines[0] and "get_rope_cpu" in lines[0]


def test_disabled_model_modules_reads_the_venv_behind_a_symlinked_interpreter(tmp_path):
    """A venv's bin/python is a symlink to the base interpreter; the model modules are looked up in the venv's own
    lib/ (resolving the link found none, so every server imported all ~250 SGLang model modules per process)."""
    import os

    from helpers.server.embedded import KEEP_MODEL_MODULES, disabled_model_modules

    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    os.symlink(sys.executable, venv / "bin" / "python")
    models = venv / "lib" / "python3.11" / "site-packages" / "sglang" / "srt" / "models"
    models.mkdir(parents=True)
    for name in ("__init__", "llama", "llama_eagle3", "deepseek_v2", "kimi_k25_eagle3", "qwen3", "falcon_mamba"):
        (models / f"{name}.py").write_text("")
    assert disabled_model_modules(venv / "bin" / "python", "deepseek_v3") == "falcon_mamba,qwen3"
    assert disabled_model_modules(venv / "bin" / "python", "llama") == "deepseek_v2,falcon_mamba,kimi_k25_eagle3,qwen3"
    assert disabled_model_modules(venv / "bin" / "python", "qwen3") is None          # unknown here: import all
    assert set(KEEP_MODEL_MODULES["deepseek_v3"]) >= {"deepseek_v2", "llama_eagle3", "kimi_k25_eagle3"}


def test_gpu_launch_script_places_hooks_on_the_target_family(tmp_path):
    """env/gpu/launch_tp8.sh builds its --forward-hooks for the target's family: on Kimi-K2.5 (the DeepSeek text model
    under language_model.) the capture hooks must name language_model.* modules or they would match nothing. The
    script runs with a PYTHON that prints the sglang.launch_server argv instead of starting a server."""
    import os

    k25 = tmp_path / "kimi-k25"
    k25.mkdir()
    (k25 / "config.json").write_text(json.dumps({"architectures": ["KimiK25ForConditionalGeneration"],
                                                 "model_type": "kimi_k25", "text_config": _target_cfg()}))
    fake = tmp_path / "python"
    fake.write_text(f"""#!{sys.executable}
import json, os, sys
if sys.argv[1:3] == ["-m", "sglang.launch_server"]:
    print(json.dumps(sys.argv[3:]))
    sys.exit(0)
os.execv({sys.executable!r}, [{sys.executable!r}] + sys.argv[1:])
""")
    fake.chmod(0o755)
    env = {**os.environ, "TARGET": str(k25), "DRAFT": str(tmp_path / "draft"), "PYTHON": str(fake),
           "LAYERS_DIR": str(tmp_path / "layers"), "HOOKS_DIR": str(tmp_path / "ranks"),
           "PYTHONPATH": os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p])}
    r = subprocess.run(["bash", str(ROOT / "env" / "gpu" / "launch_tp8.sh")], env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    argv = json.loads(r.stdout.strip().splitlines()[-1])
    hooks = json.loads(argv[argv.index("--forward-hooks") + 1])
    modules = {m for h in hooks for m in h["target_modules"]}
    assert "--disable-cuda-graph" in argv
    assert modules and all(m.startswith("language_model.") for m in modules), modules
    assert {"language_model.model.norm", "language_model.model.layers.1.input_layernorm",
            "language_model.logits_processor"} <= modules


def test_nextn_launch_flags_and_refusals(tmp_path):
    """NEXTN without a draft folder: the speculative flags without --speculative-draft-model-path (SGLang then loads
    the target's own NextN layer: arg_groups/speculative_hook.py::handle_speculative_decoding); refused before any
    launch for a target without num_nextn_predict_layers 1 and for an EAGLE-3 draft folder under NEXTN."""
    from helpers.server.embedded import build_command
    from helpers.server.settings import SpecSettings
    spec = SpecSettings(algorithm="NEXTN", num_steps=1, topk=1, num_draft_tokens=2)
    cmd = build_command(Path("py"), tmp_path, draft=None, tp=2, spec=spec, port=12345, dtype="float32",
                        max_total_tokens=8192, return_hidden_states=False, enable_metrics=False, forward_hooks=None,
                        api_key=None, extra_args=())
    i = cmd.index("--speculative-algorithm")
    assert cmd[i:i + 8] == ["--speculative-algorithm", "NEXTN", "--speculative-num-steps", "1",
                            "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "2"]
    assert "--speculative-draft-model-path" not in cmd
    no_mtp = _folder(tmp_path, "t0", _target_cfg(num_nextn_predict_layers=0))
    with pytest.raises(BadServerInput, match="num_nextn_predict_layers is 0"):
        start(no_mtp, None, tp=1, spec=spec, python=tmp_path / "no-such-python")
    good = _folder(tmp_path, "t1", _target_cfg(num_nextn_predict_layers=1))
    eagle = _folder(tmp_path, "d", _mla_draft_cfg())
    with pytest.raises(BadServerInput, match="is not a NextN checkpoint"):
        start(good, eagle, tp=1, spec=spec, python=tmp_path / "no-such-python")
    with pytest.raises(BadServerInput, match="SGLang interpreter"):     # the checks passed: it looks for SGLang
        start(good, None, tp=1, spec=spec, python=tmp_path / "no-such-python")
