"""compare-engines' arguments and targets, and URLs checked before any folder is made (issue 40).

The servers are fake SGLang look-alikes on 127.0.0.1 (tests/support/fakeserver.py, stopped by PID) whose
``/server_info`` names the target folders the test builds; every folder is made here."""
from __future__ import annotations

import json
import shutil

import pytest

from helpers.__main__ import main
from helpers.errors import BadInput, BadParams
from helpers.investigation.attach import Attachment, same_model
from helpers.investigation.cross_engine import check_targets
from helpers.redaction import REDACTED, scrub
from helpers.server.client import check_url, server_key
from helpers.suite.params import load_params
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


def _url_commands(url: str, tmp_path) -> list[tuple[list[str], str]]:
    """(argv, the flag its message names) of every command that takes a server URL, ``url`` in that flag."""
    out = ["--out", str(tmp_path / "outputs")]
    good = f"http://127.0.0.1:{free_port()}"
    return [(["investigate", "--url", url, "--training", "env/models/data/sample", *out], "--url"),
            (["ablate", "--url", url, *out], "--url"),
            (["capture", "--url", url, "--training", "env/models/data/sample"], "--url"),
            (["measure", "--url", url, "--outputs", str(tmp_path / "outputs")], "--url"),
            (["measure", "--url", good, "--baseline-url", url, "--outputs", str(tmp_path / "outputs")],
             "--baseline-url"),
            (["watch", "--url", url, "--outputs", str(tmp_path / "outputs"), "--samples", "1"], "--url"),
            (["server", "detect", "--url", url, "--timeout", "5"], "--url"),
            (["compare-engines", "--a", url, "--b", good, "--training", "env/models/data/sample", *out], "--a"),
            (["compare-engines", "--a", good, "--b", url, "--training", "env/models/data/sample", *out], "--b")]


#: malformed URLs with credentials (issue 40 follow-up): no scheme, one slash, no colon, a port that is no number,
#: an unbalanced IPv6 bracket, a scheme urllib reads as the user name
MALFORMED_WITH_PASSWORD = ["u:{pw}@127.0.0.1:1", "http:/u:{pw}@127.0.0.1:1", "https//u:{pw}@host:1",
                           "http://u:{pw}@127.0.0.1:notaport", "http://u:{pw}@[::1", "http:u:{pw}@127.0.0.1:1"]


@pytest.mark.parametrize("shape", MALFORMED_WITH_PASSWORD)
def test_a_refused_url_is_echoed_without_its_password(shape, tmp_path, monkeypatch, capsys):
    pw = f"pw-{MALFORMED_WITH_PASSWORD.index(shape)}-7c1e9a"          # one password per shape (secrets stay known)
    url = shape.format(pw=pw)
    with pytest.raises(BadInput) as exc:                       # the message itself, before any stream is scrubbed
        check_url(url, "--url")
    assert pw not in str(exc.value) and REDACTED in str(exc.value), str(exc.value)
    assert str(exc.value).startswith("[--url]: url must look like http://host:port, got "), str(exc.value)
    assert pw not in scrub(f"the server said {pw}")            # learnt: later output is scrubbed of it too
    monkeypatch.setenv("E3F_OUTPUTS", str(tmp_path / "outputs"))
    (tmp_path / "outputs").mkdir()
    for argv, flag in _url_commands(url, tmp_path):
        assert main(argv) == 2, argv
        line = _line(capsys, argv[0])
        assert f"[{flag}]: url must look like http://host:port, got '" in line and pw not in line, line
        assert REDACTED in line, line
        assert not list((tmp_path / "outputs").iterdir()), argv


def test_a_refused_params_server_url_is_echoed_without_its_password(tmp_path):
    pw = "pw-params-5d2b81"
    params = tmp_path / "p.yaml"
    params.write_text(f'server: {{url: "http:/u:{pw}@127.0.0.1:1"}}\nnotebooks: [01_attach]\n')
    with pytest.raises(BadParams) as exc:
        load_params(params)
    assert "field 'server.url': url must look like" in str(exc.value) and pw not in str(exc.value), str(exc.value)


@pytest.mark.parametrize("url", ["http://127.0.0.1:18803/?x=1", "http://127.0.0.1:18803?token=abcd1234",
                                 "http://127.0.0.1:18803/#frag", "http://127.0.0.1:18803/?"])
def test_a_url_with_a_query_or_fragment_is_refused_before_any_folder(url, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("E3F_OUTPUTS", str(tmp_path / "outputs"))
    (tmp_path / "outputs").mkdir()
    for argv, flag in _url_commands(url, tmp_path):
        assert main(argv) == 2, argv
        line = _line(capsys, argv[0])
        assert f"[{flag}]: give the server's base URL (http://host:port[/path]), without a query string or " \
               "fragment; got 'http://127.0.0.1:18803" in line, line
        got = line.split(" got ", 1)[1]
        assert got in ("'http://127.0.0.1:18803/' followed by one", "'http://127.0.0.1:18803' followed by one"), \
            line                                                # the query (it may hold a token) not echoed
        assert not list((tmp_path / "outputs").iterdir()), argv
    assert check_url("http://127.0.0.1:18803/v1/") == "http://127.0.0.1:18803/v1/"      # a path is a base URL
