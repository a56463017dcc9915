"""Extra engine flags may not move a listener off 127.0.0.1 (issue 40): every spelling of every listener flag
(:data:`helpers.server.listener_flags.LISTENER_FLAGS`) is parsed by the engine's own argument parser -- SGLang
0.5.23's (env/reference/.venv) and vLLM 0.32.0's (env/vllm/.venv) -- and must land on that listener setting and be
refused; no other flag of either parser is refused; ``server start ... -- --host 0.0.0.0`` stops with one line
before any process starts."""
from __future__ import annotations

import json
import subprocess
import sys

import psutil
import pytest

from helpers.engines.vllm_server import build_command as vllm_command
from helpers.engines.vllm_server import vllm_python
from helpers.__main__ import main
from helpers.errors import BadInput, BadServerInput
from helpers.paths import DEFAULT_SGLANG_PYTHON
from helpers.server.embedded import build_command as sglang_command
from helpers.server.listener_flags import LISTENER_FLAGS, command_engines, listener_flag, refuse_listener_flags
from helpers.server.restart import relaunch_argv, set_flags

from support import ROOT
from support.fakeserver import free_port

#: a value each listener flag takes (JSON for the config flags)
VALUES = {"--port": "31999", "--uds": "/tmp/e3f-test.sock", "--dist-init-addr": "0.0.0.0:5000",
          "--nccl-init-addr": "0.0.0.0:5000", "--kv-events-config": '{"endpoint": "tcp://*:5557"}',
          "--kv-transfer-config": '{"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_port": 15000}',
          "--ec-transfer-config": '{"ec_connector": "X", "ec_role": "ec_both", "ec_ip": "0.0.0.0"}',
          "--load-publish-endpoint": "tcp://0.0.0.0:6000", "--decoupled-spec-bind-endpoint": "tcp://0.0.0.0:6001", "--disaggregation-mode": "prefill"}

#: run in the engine's venv: argv JSON {engine, flags: {flag: value}, config: path}; prints every option string with
#: its dest and, per spelling of each flag (plain, =, the shortest abbreviation argparse expands, vLLM's underscores
#: and dotted JSON keys), the dests the parse changed from the bare model's
PARSE = r"""
import json, sys, argparse
req = json.loads(sys.argv[1])
if req["engine"] == "sglang":
    from sglang.srt.server_args import ServerArgs
    def parser():
        p = argparse.ArgumentParser(); ServerArgs.add_cli_args(p); return p
    base = ["--model-path", "m"]
else:
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    def parser():
        return make_arg_parser(FlexibleArgumentParser())
    base = ["--model", "m"]
p = parser()
opts = {o: a.dest for a in p._actions for o in a.option_strings}
bare = vars(p.parse_args(base))
out = []
for flag, value in req["flags"].items():
    forms = [[flag, value], [flag + "=" + value]]
    if flag.startswith("--"):
        for n in range(3, len(flag)):
            pre = flag[:n]
            if pre not in opts and [o for o in opts if o.startswith(pre)] == [flag]:
                forms.append([pre, value]); break
        if req["engine"] == "vllm" and "-" in flag[2:]:
            forms.append(["--" + flag[2:].replace("-", "_"), value])
        if req["engine"] == "vllm" and flag == "--kv-events-config":
            forms.append(["--kv-events-config.endpoint", "tcp://*:5557"])
    for form in forms:
        try:
            ns = vars(parser().parse_args(base + form))
            changed = sorted(k for k in ns if str(ns[k]) != str(bare.get(k)))
        except (SystemExit, Exception) as exc:
            changed = ["error: " + type(exc).__name__ + " " + str(exc)[:200]]
        out.append([form, changed])
print(json.dumps({"opts": opts, "parsed": out}))
"""

ENGINES = {"sglang": DEFAULT_SGLANG_PYTHON, "vllm": vllm_python()}


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_every_spelling_the_engines_parser_takes_is_refused_and_nothing_else(engine, tmp_path):
    python = ENGINES[engine]
    if not python.exists():
        pytest.skip(f"{python} missing (env/reference/install.sh, env/vllm/install.sh)")
    config = tmp_path / "flags.yaml"
    config.write_text("host: 0.0.0.0\n")
    flags = {f: (str(config) if f == "--config" else VALUES.get(f, "0.0.0.0")) for f in LISTENER_FLAGS[engine]}
    out = subprocess.run([str(python), "-c", PARSE, json.dumps({"engine": engine, "flags": flags})],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    doc = json.loads(out.stdout.strip().splitlines()[-1])
    opts, parsed = doc["opts"], doc["parsed"]
    dests = {opts[f] for f in LISTENER_FLAGS[engine]}
    # every option string of those settings (aliases included) is listed
    assert sorted(o for o, d in opts.items() if d in dests) == sorted(LISTENER_FLAGS[engine])
    for form, changed in parsed:
        flag = listener_flag(form[0], engine)
        assert flag is not None, form
        if flag == "--config" and engine == "vllm" and form[0] == "--config":
            assert changed == ["host"], (form, changed)          # the YAML's host: vLLM reads the file itself
        else:
            assert changed == [opts[flag]], (form, changed)      # the engine's parser sets that listener
        with pytest.raises(BadServerInput, match=f"sets {flag}:"):
            refuse_listener_flags(["--enable-metrics", *form], engine)
    assert len(parsed) >= 3 * len(LISTENER_FLAGS[engine]) - 2        # the abbreviations were found
    others = [o for o in opts if o not in LISTENER_FLAGS[engine] and listener_flag(o, engine) is not None]
    assert others == []                                             # no other flag of the parser is refused
    assert [o for o in opts if o not in LISTENER_FLAGS[engine] and listener_flag(o + "=1", engine)] == []


def test_the_command_builders_refuse_them_too(tmp_path):
    for build, engine, kw in ((sglang_command, "sglang", dict(spec=None, max_total_tokens=64,
                                                               return_hidden_states=False, enable_metrics=False,
                                                               forward_hooks=None)),
                              (vllm_command, "vllm", dict(num_speculative_tokens=3, max_model_len=64,
                                                           max_num_seqs=1))):
        base = dict(draft=None, tp=1, port=31000, dtype="float32", api_key=None, **kw)
        cmd = build(tmp_path / "py", tmp_path, extra_args=["--disable-radix-cache"], **base)
        assert cmd[cmd.index("--host") + 1] == "127.0.0.1" and cmd.count("--host") == 1
        with pytest.raises(BadServerInput, match="--host=0.0.0.0"):
            build(tmp_path / "py", tmp_path, extra_args=["--host=0.0.0.0"], **base)
        with pytest.raises(BadServerInput, match="sets --port.*own --port"):
            build(tmp_path / "py", tmp_path, extra_args=["--port", "1"], **base)


@pytest.mark.parametrize("extra,named", [(["--host", "0.0.0.0"], "'--host'"), (["--host=0.0.0.0"], "'--host=0.0.0.0'"),
                                         (["--dist-init-addr", "0.0.0.0:5000"], "'--dist-init-addr'")])
def test_server_start_refuses_before_anything_starts(extra, named, tmp_path):
    """The real CLI (`python -m helpers server start ... -- FLAGS`), as a user runs it: one line naming the flag,
    exit 2, no child process ever started, no registry or state file written."""
    state = tmp_path / "state.json"
    proc = subprocess.Popen([sys.executable, "-m", "helpers", "server", "start", "--detach", "--state-file",
                             str(state), "--", *extra], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    me = psutil.Process(proc.pid)
    children = set()
    while proc.poll() is None:
        try:
            children |= {c.pid for c in me.children(recursive=True)}
        except psutil.Error:
            break
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"server: error: {named} among the extra sglang flags"), err
    assert children == set() and list(tmp_path.iterdir()) == []


def _program(tmp_path, name: str) -> str:
    """An executable file ``name`` (the program word of a relaunch command; never run here)."""
    p = tmp_path / name
    p.write_text("#!/bin/sh\nexit 1\n")
    p.chmod(0o755)
    return str(p)


@pytest.mark.parametrize("program, words, named", [
    ("sglang", "--ho 0.0.0.0 --port 1", "'--ho' in the launch command sets --host: the HTTP server's address"),
    ("sglang", "--host 127.0.0.1 --dist-init-addr 0.0.0.0:5000", "'--dist-init-addr' in the launch command sets "
                                                                  "--dist-init-addr"),
    ("sglang", "--dist_init_addr=0.0.0.0:5000", "'--dist_init_addr=0.0.0.0:5000' in the launch command sets "
                                                "--dist-init-addr"),
    ("sglang", "--host.x 0.0.0.0", "'--host.x' in the launch command sets --host"),
    ("sglang", "--po 1", "'--po' in the launch command sets --port"),     # the tool replaces the exact --port only
    ("vllm", "--data_parallel_address 0.0.0.0", "'--data_parallel_address' in the launch command sets "
                                                "--data-parallel-address"),
    ("vllm", "-dpa 0.0.0.0", "'-dpa' in the launch command sets -dpa"),
    ("vllm", "--uds /tmp/e3f.sock", "'--uds' in the launch command sets --uds"),
    ("wrapper", "--uds /tmp/e3f.sock", "'--uds' in the launch command sets --uds"),      # neither named: both lists
    ("wrapper", "--disaggregation-mode prefill", "'--disaggregation-mode' in the launch command sets "
                                                 "--disaggregation-mode"),
])
def test_a_relaunch_command_may_hold_no_listener_flag_but_the_exact_host_and_port(program, words, named, tmp_path):
    """issue 40 follow-up: ``--relaunch "... --ho 0.0.0.0 --dist-init-addr 0.0.0.0:5000 --port 1"`` ran the fixed copy
    with ``--ho 0.0.0.0 --dist-init-addr 0.0.0.0:5000 --host 127.0.0.1 --port N`` (set_flags replaces the exact
    --host / --port only): every other listener flag of the command's engine is refused, naming it."""
    head = {"sglang": f"{sys.executable} -m sglang.launch_server --model-path /m",
            "vllm": f"{_program(tmp_path, 'vllm')} serve /m",
            "wrapper": f"{_program(tmp_path, 'run.sh')} --model /m"}[program]
    with pytest.raises(BadInput) as exc:
        relaunch_argv(f"{head} {words}")
    assert exc.value.field == "--relaunch" and exc.value.message.startswith(named), str(exc.value)


def test_the_exact_host_and_port_of_a_relaunch_command_are_replaced_and_its_engine_decides(tmp_path):
    sglang = f"{sys.executable} -m sglang.launch_server --model-path /m"
    for words in ("--host 0.0.0.0 --port 1", "--host=0.0.0.0 --port=1"):
        argv = relaunch_argv(f"{sglang} {words} --enable-metrics")
        fixed = set_flags(argv, {"--host": "127.0.0.1", "--port": "31000"})
        assert fixed[-4:] == ["--host", "127.0.0.1", "--port", "31000"] and "0.0.0.0" not in fixed, fixed
        assert [w for w in fixed if w.startswith("--host") or w.startswith("--port")] == ["--host", "--port"]
    assert relaunch_argv(f"{sglang} --uds /tmp/x")[-2:] == ["--uds", "/tmp/x"]     # no SGLang flag: not its list
    vllm = _program(tmp_path, "vllm")
    assert command_engines([vllm, "serve", "/m", "--host", "h"]) == ("vllm",)
    assert command_engines(["python3", "-m", "vllm.entrypoints.openai.api_server", "--model", "/m"]) == ("vllm",)
    assert command_engines(["python", "-m", "sglang.launch_server", "--model-path", "/vllm"]) == ("sglang",)
    assert command_engines(["/opt/run.sh", "--model", "/m"]) == ("sglang", "vllm")
    assert relaunch_argv(f"{vllm} serve /m --disaggregation-mode prefill")[-1] == "prefill"   # SGLang's, not vLLM's


@pytest.mark.parametrize("cmd", ["investigate", "ablate"])
def test_investigate_and_ablate_refuse_such_a_relaunch_before_any_folder_or_request(cmd, tmp_path, capsys):
    relaunch = (f"{sys.executable} -m sglang.launch_server --model-path /m --ho 0.0.0.0 "
                "--dist-init-addr 0.0.0.0:5000 --port 1")
    argv = [cmd, "--url", f"http://127.0.0.1:{free_port()}", "--relaunch", relaunch, "--out", str(tmp_path / "o")]
    argv += ["--training", "env/models/data/sample"] if cmd == "investigate" else []
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"{cmd}: error: [--relaunch]: '--ho' in the launch command sets "
                                               "--host"), err
    assert not (tmp_path / "o").exists() or not list((tmp_path / "o").iterdir())
