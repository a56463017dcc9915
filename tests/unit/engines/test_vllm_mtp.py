"""vLLM 0.32.0 serving a target's own MTP head on its CPU backend (helpers.engines.vllm_mtp), without a server: which
targets it refuses and why (the committed Kimi-class target: MLA latent 72, the CPU MLA backends take 576), the
launch command, the CLI seam, the state each family's head is fed. The live check is
tests/server/test_vllm_mtp_server.py (extended)."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from helpers.engines import vllm_mtp
from helpers.engines.vllm import VLLMAdapter
from helpers.engines.vllm_server import build_command, start
from helpers.errors import BadServerInput
from helpers.layers.mtp import mtp_head
from support import ROOT

KIMI = ROOT / "env" / "models" / "kimi" / "target"
H64 = ROOT / "env" / "models" / "llama_h64" / "target"


def _mimo_cfg() -> dict:
    """The config make_mimo_pair.py writes (the llama_h64 target as MiMoForCausalLM with one MTP layer)."""
    cfg = json.loads((H64 / "config.json").read_text())
    cfg.update({"architectures": ["MiMoForCausalLM"], "model_type": "qwen2", "num_nextn_predict_layers": 1})
    return cfg


def test_kimi_class_target_is_refused_with_vllm_cpu_mla_reason():
    cfg = json.loads((KIMI / "config.json").read_text())
    why = vllm_mtp.cpu_refusal(cfg)
    width = cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]
    assert width == 72
    assert f"= {width}" in why and "[576]" in why
    assert f"invalid weight input features {cfg['qk_nope_head_dim']}" in why          # AMX_MLA, at start
    assert f"Head dimension {width} is not supported by MLA." in why                  # CPU_MLA, first request
    with pytest.raises(BadServerInput, match=str(KIMI / "config.json")):
        vllm_mtp.check_mtp_target(KIMI)
    # the same config with DeepSeek-V3's latent (512 + 64) is not refused by this check
    assert vllm_mtp.cpu_refusal({**cfg, "kv_lora_rank": 512, "qk_rope_head_dim": 64}) is None


def test_mimo_pair_config_is_served_and_heads_without_layers_are_refused():
    cfg = _mimo_cfg()
    assert vllm_mtp.cpu_refusal(cfg) is None
    assert "num_nextn_predict_layers is 0" in vllm_mtp.cpu_refusal({**cfg, "num_nextn_predict_layers": 0})
    assert "num_nextn_predict_layers is None" in vllm_mtp.cpu_refusal(
        {k: v for k, v in cfg.items() if k != "num_nextn_predict_layers"})
    plain = json.loads((H64 / "config.json").read_text())                               # LlamaForCausalLM
    assert "is not a target vLLM 0.32.0 maps to an MTP head" in vllm_mtp.cpu_refusal(plain)


def test_fed_state_per_family():
    ds = mtp_head(json.loads((KIMI / "config.json").read_text()))
    mimo = mtp_head(_mimo_cfg())
    assert vllm_mtp.fed_state(ds)[0] == "norm(out(n-1))" and "deepseek_v2.py::DeepseekV2Model.forward" in \
        vllm_mtp.fed_state(ds)[1]
    assert vllm_mtp.fed_state(mimo)[0] == "out(n-1)" and "mimo.py::MiMoModel.forward" in vllm_mtp.fed_state(mimo)[1]


def test_launch_command_runs_method_mtp_without_a_model():
    spec = vllm_mtp.speculative_config(2)
    cmd = build_command(ROOT / "python", H64, draft=None, tp=1, num_speculative_tokens=2, port=18000,
                        dtype="float32", max_model_len=512, max_num_seqs=8, api_key=None, extra_args=(),
                        speculative=spec)
    cfg = json.loads(cmd[cmd.index("--speculative-config") + 1])
    assert cfg == {"method": "mtp", "num_speculative_tokens": 2}
    assert cmd[cmd.index("--per-request-spec-decode-metrics") + 1] == "detailed"
    with pytest.raises(BadServerInput, match="num_speculative_tokens must be >= 1"):
        vllm_mtp.speculative_config(0)


def test_start_refuses_before_any_process(tmp_path):
    with pytest.raises(BadServerInput, match="MLA latent width"):
        start(KIMI, None, mtp=True, python=tmp_path / "no-python")
    with pytest.raises(BadServerInput, match="give no draft folder"):
        start(H64, H64, mtp=True, python=tmp_path / "no-python")


def _args(**kw):
    base = dict(forward_hooks=None, faults=None, capture_ranks=None, capture_layers=None, trace_draft=None,
                algorithm="EAGLE3", topk=1, draft_tokens=None, reference_draft=False, target=str(H64), nextn=False)
    return SimpleNamespace(**{**base, **kw})


def test_cli_seam_takes_nextn_and_refuses_algorithm_nextn_without_it():
    a = VLLMAdapter()
    assert a.cli_refusal(_args(algorithm="NEXTN", nextn=True)) is None
    assert "--algorithm" in a.cli_refusal(_args(algorithm="NEXTN"))
    assert "--algorithm" in a.cli_refusal(_args(algorithm="EAGLE", nextn=False))
    assert a.cli_refusal(_args()) is None


def test_config_check_says_what_vllm_feeds_and_that_its_cpu_backend_refuses_the_kimi_target(tmp_path):
    from helpers.draft.mtp_checks import MTPSpec, check_mtp
    from helpers.engines.vllm_rules import VLLMMTPRules
    rep = check_mtp(KIMI, KIMI, spec=MTPSpec(num_steps=1), rules=VLLMMTPRules())
    facts, notes = rep.draft_checks["facts"], rep.draft_checks["notes"]
    assert facts["loads"]["fed_state"]["candidate"] == "norm(out(n-1))"
    assert any("CPU backend" in n and "MLA latent width" in n and "= 72" in n for n in notes)
    (tmp_path / "config.json").write_text(json.dumps(_mimo_cfg()))
    rep = check_mtp(tmp_path, tmp_path, spec=MTPSpec(num_steps=1), rules=VLLMMTPRules())
    facts, notes = rep.draft_checks["facts"], rep.draft_checks["notes"]
    assert facts["loads"]["class"] == "MiMoMTPModel" and facts["loads"]["fed_state"]["candidate"] == "out(n-1)"
    assert not any("CPU backend" in n for n in notes)
