"""vLLM 0.32.0's ablation toggles and restarts without a server: every toggle's flags parsed by vLLM's own argument
parser and speculative config (in env/vllm/.venv), each skipped with a reason read from the server's settings, and a
user's launch command rewritten for a restarted copy."""
from __future__ import annotations

import json
import subprocess

import pytest

from helpers.engines.vllm import TOGGLES, relaunch_command
from helpers.engines.vllm_server import vllm_python

INFO = {"engine": "vllm", "version": "0.32.0", "speculative_algorithm": "EAGLE3", "enable_prefix_caching": True,
        "async_scheduling": False, "draft_sample_method": "greedy", "rejection_sample_method": "standard"}

PARSE = r"""
import json, sys, dataclasses, typing
from vllm.engine.arg_utils import EngineArgs
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.config.speculative import SpeculativeConfig
flags = json.loads(sys.argv[1])
out = {}
for name, argv in flags.items():
    ns = EngineArgs.add_cli_args(FlexibleArgumentParser()).parse_args(["--model", "m", *argv])
    out[name] = {"enable_prefix_caching": ns.enable_prefix_caching, "async_scheduling": ns.async_scheduling}
fields = {f.name: str(f.type) for f in dataclasses.fields(SpeculativeConfig)}
print(json.dumps({"parsed": out, "spec_fields": fields}))
"""


def test_skip_reasons_come_from_the_servers_own_settings():
    by = {t.name: t for t in TOGGLES}
    assert by["prefix_caching_off"].skip_reason(INFO) is None
    assert "already off" in by["async_scheduling_off"].skip_reason(INFO)
    assert by["draft_sample_probabilistic"].skip_reason(INFO) is None and by["draft_sample_probabilistic"].sampled
    assert "already" in by["draft_sample_probabilistic"].skip_reason({**INFO, "draft_sample_method": "probabilistic"})
    assert "without a draft" in by["draft_off"].skip_reason({**INFO, "speculative_algorithm": None})
    assert all("vllm" in t.report for t in TOGGLES if t.speculative)


@pytest.mark.skipif(not vllm_python().exists(), reason="env/vllm/.venv is missing (make setup without SKIP_VLLM=1)")
def test_every_toggle_is_a_flag_or_a_speculative_field_of_vllm_0_32():
    cli = {t.name: [w for k, v in t.flags.items() if not k.startswith("speculative_config.")
                    for w in ([k] if v is None else [k, str(v)])] for t in TOGGLES}
    out = subprocess.run([str(vllm_python()), "-c", PARSE, json.dumps(cli)], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    doc = json.loads(out.stdout.strip().splitlines()[-1])
    assert doc["parsed"]["prefix_caching_off"]["enable_prefix_caching"] is False
    assert doc["parsed"]["async_scheduling_off"]["async_scheduling"] is False
    for t in TOGGLES:
        for k, v in t.flags.items():
            if k.startswith("speculative_config."):
                field = k.split(".", 1)[1]
                assert field in doc["spec_fields"] and repr(v) in doc["spec_fields"][field].replace('"', "'"), \
                    (field, v, doc["spec_fields"].get(field))


def test_a_users_launch_command_is_rewritten_for_the_restarted_copy():
    argv = ["vllm", "serve", "/m/target", "--host", "0.0.0.0", "--port", "8000", "--speculative-config",
            json.dumps({"method": "eagle3", "model": "/m/draft", "num_speculative_tokens": 3})]
    new = relaunch_command(argv, draft="/run/drafts/proposed", keep_draft=True, port=12345,
                           flags={"--no-enable-prefix-caching": None}, spec={"draft_sample_method": "probabilistic"})
    cfg = json.loads(new[new.index("--speculative-config") + 1])
    assert cfg == {"method": "eagle3", "model": "/run/drafts/proposed", "num_speculative_tokens": 3,
                   "draft_sample_method": "probabilistic"}
    assert new[new.index("--host") + 1] == "127.0.0.1" and new[new.index("--port") + 1] == "12345"
    assert "--no-enable-prefix-caching" in new and new.count("--speculative-config") == 1
    alone = relaunch_command(argv, draft=None, keep_draft=False, port=12346, flags={}, spec={})
    assert "--speculative-config" not in alone and alone[:3] == ["vllm", "serve", "/m/target"]
