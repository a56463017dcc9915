"""compare-engines' arguments and targets, and URLs checked before any folder is made (issue 40).

The servers are fake SGLang look-alikes on 127.0.0.1 (tests/support/fakeserver.py, stopped by PID) whose
``/server_info`` names the target folders the test builds; every folder is made here."""
from __future__ import annotations

import json
import shutil

import pytest

from helpers.__main__ import main
from helpers.errors import BadInput
from helpers.investigation.attach import Attachment, same_model
from helpers.investigation.cross_engine import check_targets
from helpers.server.client import server_key
from support.fakeserver import fake_server, free_port


def _line(capsys, prog: str) -> str:
    err = [ln for ln in capsys.readouterr().err.strip().splitlines() if not ln.startswith(f"[{prog}]")]
    assert len(err) == 1 and err[0].startswith(f"{prog}: error:"), err
    assert "Traceback" not in err[0] and "Error:" not in err[0], err[0]
    return err[0]


@pytest.mark.parametrize("a, b", [
    ("http://127.0.0.1:30000", "http://127.0.0.1:30000/"),
    ("http://localhost:30000", "http://127.0.0.1:30000"),
    ("HTTP://LOCALHOST:30000/", "http://[::1]:30000"),
    ("http://user:pw@127.0.0.1:30000", "http://127.0.0.1:30000"),
    ("http://host.example", "http://host.example:80"),
    # issue 40: other spellings of one address (the C resolver's IPv4 shorthand / integer / hex forms, IPv4-mapped IPv6)
    ("http://127.0.0.1:18803", "http://127.1:18803"),
    ("http://127.0.0.1:18803", "http://2130706433:18803"),
    ("http://127.0.0.1:18803", "http://[::ffff:127.0.0.1]:18803"),
    ("http://localhost:18803", "http://0x7f.0.0.1:18803"),
    ("http://10.0.0.1:18803", "http://10.1:18803"),
    ("http://[::FFFF:10.0.0.1]:18803", "http://10.0.0.1:18803"),
])
def test_compare_engines_refuses_one_server_given_twice(a, b, tmp_path, capsys):
    assert main(["compare-engines", "--a", a, "--b", b, "--training", "env/models/data/sample",
                 "--out", str(tmp_path)]) == 2
    line = _line(capsys, "compare-engines")
    assert "--a and --b name the same server" in line and "pw" not in line, line
    assert not list(tmp_path.iterdir())        # before any folder


def test_server_key_tells_servers_apart():
    assert server_key("http://127.0.0.1:30000") != server_key("http://127.0.0.1:30001")
    assert server_key("http://127.0.0.1:30000") != server_key("https://127.0.0.1:30000")
    assert server_key("http://127.0.0.1:30000/a") != server_key("http://127.0.0.1:30000/b")
    assert server_key("http://10.0.0.1:30000") != server_key("http://10.0.0.2:30000")
    assert server_key("http://127.0.0.2:30000") != server_key("http://127.0.0.1:30000")   # another address
    assert server_key("http://10.1:30000") != server_key("http://10.0.1.0:30000")
    assert server_key("http://deadbeef:30000")[1] == "deadbeef"          # a name, not hex: no DNS, kept as is
    assert server_key("http://[2001:DB8::0:1]:30000")[1] == "2001:db8::1"


def _att(served: str, target_dir) -> Attachment:
    return Attachment(url="http://x", version="0.5.23", tp=1, algorithm="EAGLE3", spec={}, served_draft=None,
                      served_target=served, draft_dir=None, draft_source="none", target_dir=target_dir,
                      target_source="server (model_path)")


def test_check_targets_refuses_two_models_and_notes_what_it_cannot_read(tiny_target, tmp_path):
    copy = shutil.copytree(tiny_target, tmp_path / "copy")
    cfg = json.loads((copy / "config.json").read_text())
    cfg["_name_or_path"] = "elsewhere"                    # where it was saved: the same model
    (copy / "config.json").write_text(json.dumps(cfg))
    assert check_targets(_att(str(tiny_target), tiny_target), _att(str(copy), copy)) is None
    assert check_targets(_att(str(tiny_target), tiny_target), _att(str(tiny_target), tiny_target)) is None

    other = shutil.copytree(tiny_target, tmp_path / "other")        # another architecture
    cfg["num_hidden_layers"] = cfg["num_hidden_layers"] + 1
    (other / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(BadInput, match=r"^\[--b\]: the two servers serve different targets .*config keys "
                                       r"num_hidden_layers"):
        check_targets(_att(str(tiny_target), tiny_target), _att(str(other), other))

    tuned = shutil.copytree(tiny_target, tmp_path / "tuned")        # same config and sizes, other weights
    w = sorted(tuned.glob("*.safetensors"))[0]
    data = bytearray(w.read_bytes())
    n = int.from_bytes(data[:8], "little")
    data[8 + n + 16] ^= 0xFF                                         # one byte of the first tensor
    w.write_bytes(bytes(data))
    assert same_model(tiny_target, tuned, "target config") is None   # names and sizes alike
    with pytest.raises(BadInput, match=rf"weight files {w.name} hold other values"):
        check_targets(_att(str(tiny_target), tiny_target), _att(str(tuned), tuned))

    note = check_targets(_att("/srv/a/llama", tiny_target), _att("/srv/b/qwen", tiny_target))
    assert note.startswith("the servers name different target folders (a: /srv/a/llama, b: /srv/b/qwen) and "
                           "neither is readable here"), note


def test_compare_engines_target_flag_is_the_one_its_message_names(tiny_target, tmp_path, capsys):
    with fake_server("ok") as a, fake_server("ok") as b:
        args = ["compare-engines", "--a", a, "--b", b, "--training", "env/models/data/sample", "--out", str(tmp_path),
                "--timeout", "30"]
        assert main(args) == 2
        line = _line(capsys, "compare-engines")
        assert "[--a]: /nonexistent/target: the server's target folder '/nonexistent/target' is not readable on " \
               "this machine: pass --target DIR" in line, line
        assert main(args + ["--target", str(tiny_target)]) == 2        # the target is read; the draft is not here
        assert "[--a]: server a runs no draft this machine can read" in _line(capsys, "compare-engines")
        assert main(args + ["--target", str(tmp_path / "none")]) == 2
        assert f"[--target]: {tmp_path / 'none'}: target config not found" in \
            _line(capsys, "compare-engines")


def test_compare_engines_refuses_two_servers_with_different_targets(tiny_target, tiny_draft, tmp_path, capsys):
    other = shutil.copytree(tiny_target, tmp_path / "other")
    cfg = json.loads((other / "config.json").read_text())
    cfg["rms_norm_eps"] = 1e-3
    (other / "config.json").write_text(json.dumps(cfg))
    with fake_server("ok", "--model-path", str(tiny_target), "--draft-path", str(tiny_draft)) as a, \
            fake_server("ok", "--model-path", str(other), "--draft-path", str(tiny_draft)) as b:
        assert main(["compare-engines", "--a", a, "--b", b, "--training", "env/models/data/sample",
                     "--out", str(tmp_path / "out"), "--timeout", "30"]) == 2
    line = _line(capsys, "compare-engines")
    assert f"[--b]: the two servers serve different targets (a: {tiny_target}, b: {other}; they differ in config " \
           "keys rms_norm_eps)" in line, line


@pytest.mark.parametrize("url", ["127.0.0.1:30000", "localhost:30000", "ftp://127.0.0.1:1", "http://", "http://h:x"])
def test_a_url_without_a_scheme_makes_no_folder(url, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("E3F_OUTPUTS", str(tmp_path / "outputs"))
    (tmp_path / "outputs").mkdir()
    out = ["--out", str(tmp_path / "outputs")]
    for argv in (["investigate", "--url", url, "--training", "env/models/data/sample", *out],
                 ["ablate", "--url", url, *out],
                 ["capture", "--url", url, "--training", "env/models/data/sample"],
                 ["measure", "--url", url, "--outputs", str(tmp_path / "outputs")],
                 ["measure", "--url", f"http://127.0.0.1:{free_port()}", "--baseline-url", url,
                  "--outputs", str(tmp_path / "outputs")]):
        assert main(argv) == 2, argv
        line = _line(capsys, argv[0])
        flag = "--baseline-url" if "--baseline-url" in argv else "--url"
        assert f"[{flag}]: url must look like http://host:port" in line, line
        assert not list((tmp_path / "outputs").iterdir()), argv
