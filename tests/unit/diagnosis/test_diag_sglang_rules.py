"""The SGLang rule table (helpers/layers/data/sglang-0.5.23-eagle3.json) is what env/reference/sglang_tables.py
derives from the installed sglang 0.5.23 source, and the rules the diagnosis relies on read as stated there."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from helpers.diagnosis.sglang_rules import draft_servable
from helpers.layers import sglang as R
from support import ROOT

PKG = sorted((ROOT / "env" / "reference" / ".venv" / "lib").glob("python3*/site-packages/sglang"))


@pytest.mark.skipif(not PKG, reason="env/reference/.venv (sglang 0.5.23) not installed")
def test_committed_table_equals_the_installed_sglang_source(tmp_path):
    out = tmp_path / "t.json"
    subprocess.run([sys.executable, str(ROOT / "env/reference/sglang_tables.py"), "--sglang", str(PKG[0]),
                    "--out", str(out)], check=True, capture_output=True, timeout=120)
    assert json.loads(out.read_text()) == json.loads(R.TABLE_PATH.read_text())


def test_rules_the_diagnosis_relies_on():
    t = R.table()
    assert t["sglang_version"] == "0.5.23"
    assert R.target_rule(["LlamaForCausalLM"]).rule == "plus_one"
    assert R.target_rule(["DeepseekV3ForCausalLM"]).rule == "deepseek"
    assert R.target_rule(["KimiK25ForConditionalGeneration"]).rule == "deepseek"        # delegates to DeepSeek
    gpt = R.target_rule(["GptOssForCausalLM"])
    assert (gpt.rule, gpt.last_layer) == ("gpt_oss", "boundary")
    assert R.target_rule(["Qwen3MoeForCausalLM"]).last_layer == "index_error"
    assert R.target_rule(["Gemma4ForConditionalGeneration"]).last_layer == "boundary"
    # the DeepSeek family packs its captures: an unreached id raises at the first forward (deepseek_v2.py)
    assert R.target_rule(["DeepseekV3ForCausalLM"]).last_layer == "runtime_error"
    assert R.target_rule(["KimiK25ForConditionalGeneration"]).last_layer == "runtime_error"
    assert R.target_rule(["LlamaForCausalLM"]).last_layer == "missing"
    assert R.target_rule(["MiniMaxM3SparseForConditionalGeneration"]).rule == "plus_one_default"
    assert not R.target_rule(["GPT2LMHeadModel"]).supports_eagle3                     # registered, no setter
    assert R.target_rule(["NoSuchModelForCausalLM"]).rule == "unregistered"
    assert R.target_rule([], "llama").architecture == "LlamaForCausalLM"
    assert R.eagle3_draft_classes() == ["Eagle3DeepseekV2ForCausalLM", "LlamaForCausalLMEagle3"]
    assert draft_servable(["LlamaForCausalLMEagle3"], "sglang") is None
    assert "not registered" in draft_servable(["DeepseekV3ForCausalLMEagle3"], "sglang")
