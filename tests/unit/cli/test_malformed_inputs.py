"""Every malformed input of measure / capture / replay / ablate is a project error (issue 30): exit 2 with one line
naming the file (and line, item or field) or the flag, no exception type and no debug suffix -- found before any
request (the servers here are closed ports, so a command that went on would fail with exit 1 "cannot connect"
instead). Each file is made by the test; each case is one a fuzz of these readers found unclassified (OverflowError,
ValueError, TypeError, RuntimeError, ZeroDivisionError, UnicodeDecodeError) or accepted and sent on."""
from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import save_file

from helpers.__main__ import main
from helpers.formats.dumps import write_dump
from support.fakeserver import free_port

H = 16


@pytest.fixture
def closed_url() -> str:
    return f"http://127.0.0.1:{free_port()}"


def _line(capsys, prog: str) -> str:
    err = [ln for ln in capsys.readouterr().err.strip().splitlines() if not ln.startswith("warning:")]
    assert len(err) == 1 and err[0].startswith(f"{prog}: error:"), err
    assert "E3F_DEBUG" not in err[0] and "Error:" not in err[0] and "Traceback" not in err[0], err[0]
    return err[0]


@pytest.mark.parametrize("name, text, where", [
    ("overflow.jsonl", '{"input_ids": [1e400]}\n', "line 1: input_ids[0] is inf"),
    ("inf.json", "[[1, Infinity]]", "item 1: input_ids[1] is inf"),
    ("float.jsonl", '{"text": "ok"}\n{"input_ids": [1.5]}\n', "line 2: input_ids[0] is 1.5"),
    ("bool.jsonl", '{"input_ids": [true]}\n', "line 1: input_ids[0] is True"),
    ("negative.jsonl", '{"input_ids": [5, -1]}\n', "line 1: input_ids[1] is -1"),
    ("huge.jsonl", '{"input_ids": [4294967296]}\n', "line 1: input_ids[0] is 4294967296"),
    ("string.jsonl", '{"input_ids": "123"}\n', "line 1: input_ids must be a list of token ids, got str"),
    ("empty.jsonl", '{"input_ids": []}\n', "line 1: input_ids is empty"),
    ("text.jsonl", '{"text": 5}\n', "line 1: text must be a string, got int"),
    ("textdict.json", '[{"text": {"a": 1}}]', "item 1: text must be a string, got dict"),
])
def test_a_malformed_prompt_file_names_the_file_and_line(name, text, where, tmp_path, closed_url, capsys):
    f = tmp_path / name
    f.write_text(text)
    assert main(["measure", "--url", closed_url, "--prompts", str(f), "--no-save", "--quiet"]) == 2
    line = _line(capsys, "measure")
    assert f"{f}: {where}" in line, line
    assert main(["ablate", "--url", closed_url, "--prompts", str(f), "--out", str(tmp_path / "out")]) == 2
    assert f"{f}: {where}" in _line(capsys, "ablate")


@pytest.mark.parametrize("flag, value, expect", [
    ("--temperature", "nan", "[--temperature]: expected a temperature in [0, 10], got nan"),
    ("--temperature", "inf", "[--temperature]: expected a temperature in [0, 10], got inf"),
    ("--temperature", "-1", "[--temperature]: expected a temperature in [0, 10], got -1.0"),
    ("--bootstrap", "-5", "[--bootstrap]: expected at least 100 bootstrap resamples, got -5"),
    ("--bootstrap", "0", "[--bootstrap]: expected at least 100 bootstrap resamples, got 0"),
    ("--warmup", "-1", "[--warmup]: expected warm-up requests >= 0, got -1"),
    ("--timeout", "nan", "--timeout must be > 0 seconds, got nan"),
    ("--num-prompts", "10000000", "[--num-prompts]: the number of prompts must be from 1 to 1000000"),
])
def test_measure_settings_out_of_range_are_bad_input(flag, value, expect, tmp_path, closed_url, capsys):
    assert main(["measure", "--url", closed_url, flag, value, "--outputs", str(tmp_path), "--quiet"]) == 2
    assert expect in _line(capsys, "measure")
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("flag, value, expect", [
    ("--port", "abc", "--port: expected a port (30000) or a range (30000-30010), got 'abc'"),
    ("--port", "99999", "--port: expected ports within 1-65535"),
    ("--temperature", "nan", "[--temperature]: expected a temperature in [0, 10], got nan"),
])
def test_ablate_and_investigate_arguments_are_checked_before_any_request(flag, value, expect, tmp_path, closed_url,
                                                                         capsys):
    assert main(["ablate", "--url", closed_url, "--sweeps", "none", "--toggles", "none", flag, value,
                 "--out", str(tmp_path)]) == 2
    assert expect in _line(capsys, "ablate")
    if flag == "--port":
        assert main(["investigate", "--url", closed_url, "--training", str(tmp_path), flag, value,
                     "--out", str(tmp_path)]) == 2
        assert expect in _line(capsys, "investigate")
    assert not list(tmp_path.iterdir())


FIX = "fixes: [{name: a, url: 'http://127.0.0.1:1', command: 'python -m x'}]\n"


@pytest.mark.parametrize("text, expect", [
    (b"\xff\xfe\x00\x01", "fixes file is not a UTF-8 text file (byte 0: invalid start byte); expected YAML"),
    ("fixes: [{name: a, url: 'http://127.0.0.1:1', command: 'x \"y'}]\n",
     "[fixes.0]: Value error, command: is not a command line (No closing quotation)"),
    (FIX + "measure: {temperature: .nan}\n", "[measure.temperature]: Input should be"),
    (FIX + "measure: {count: 99999999999999999999999}\n", "[measure.count]: Input should be less than or equal to"),
])
def test_a_malformed_fixes_file_is_bad_input_before_any_server_starts(text, expect, tmp_path, capsys):
    f = tmp_path / "fixes.yaml"
    f.write_bytes(text if isinstance(text, bytes) else text.encode())
    assert main(["measure", "--fixes", str(f), "--outputs", str(tmp_path / "out"), "--quiet"]) == 2
    line = _line(capsys, "measure")
    assert f"{f} " in line or f"{f}:" in line, line
    assert expect in line, line
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())


def test_a_case_file_that_is_not_text_is_bad_input(tmp_path, capsys):
    f = tmp_path / "case.yaml"
    f.write_bytes(b"name: x\n\xff\xfe")
    assert main(["replay", str(f), "--out", str(tmp_path / "out"), "--quiet"]) == 2
    assert f"{f}: case file is not a UTF-8 text file" in _line(capsys, "replay")


def _ckpt(folder, record):
    folder.mkdir()
    torch.save(record, folder / "data_0.ckpt")
    return folder / "data_0.ckpt"


AUX = torch.randn(1, 5, 3 * H, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("record, field, expect", [
    ({"input_ids": ["a", "b"], "aux_hidden_state": AUX}, "input_ids", "expected a 1-D integer tensor, got list"),
    ({"input_ids": None, "aux_hidden_state": AUX}, "input_ids", "expected a 1-D integer tensor, got NoneType"),
    ({"input_ids": [[1, 2], [3]], "aux_hidden_state": AUX}, "input_ids", "expected a 1-D integer tensor, got list"),
    ({"input_ids": torch.arange(5), "loss_mask": "abcde", "aux_hidden_state": AUX}, "loss_mask",
     "expected a 1-D integer tensor, got str"),
    ({"input_ids": torch.tensor([3, -1, 4, 5, 6]), "aux_hidden_state": AUX}, "input_ids",
     "token id -1 is not from 0 to 2147483647"),
    ({"input_ids": torch.ones(5, dtype=torch.complex64), "aux_hidden_state": AUX}, "input_ids",
     "expected a 1-D integer tensor, got (5,) torch.complex64"),
    ({"input_ids": torch.arange(5), "aux_hidden_state": torch.zeros(1, 5, 0)}, "aux_hidden_state",
     "rows are 0 wide"),
])
def test_malformed_specforge_training_data_names_the_file_and_key(record, field, expect, tmp_path, closed_url, capsys):
    f = _ckpt(tmp_path / "train", record)
    assert main(["capture", "--url", closed_url, "--training", str(tmp_path / "train"), "--num-samples", "1"]) == 2
    line = _line(capsys, "capture")
    assert f"{f} [{field}]: {expect}" in line, line


def test_malformed_speculators_data_and_dumps_name_the_file_and_field(tmp_path, closed_url, capsys):
    (tmp_path / "hs").mkdir()
    save_file({"token_ids": torch.arange(5), "hidden_states": torch.ones(5, 3, H, dtype=torch.int32)},
              str(tmp_path / "hs" / "hs_0.safetensors"))
    args = ["capture", "--url", closed_url, "--num-samples", "1", "--training"]
    assert main(args + [str(tmp_path / "hs")]) == 2
    assert (f"{tmp_path / 'hs' / 'hs_0.safetensors'} [hidden_states]: expected a floating-point tensor, got "
            "torch.int32") in _line(capsys, "capture")

    def dump(name, patch):
        d = write_dump(tmp_path / name, [{"key": "s0", "input_ids": torch.arange(5), "hidden": torch.randn(5, 3 * H)}],
                       {"kind": "training", "hidden_size": H})
        m = json.loads((d / "manifest.json").read_text())
        patch(m)
        (d / "manifest.json").write_text(json.dumps(m))
        return d

    d = dump("h0", lambda m: m.update(hidden_size=0))
    assert main(args + [str(d)]) == 2
    assert f"{d / 'manifest.json'} [hidden_size]: Input should be greater than 0" in _line(capsys, "capture")
    d = dump("dup", lambda m: m["samples"].append(dict(m["samples"][0])))
    assert main(args + [str(d)]) == 2
    assert f"{d / 'manifest.json'} [samples]: Value error, sample key 's0' is listed twice" in _line(capsys, "capture")
    (tmp_path / "trunc").mkdir()
    (tmp_path / "trunc" / "hs_0.safetensors").write_bytes(struct.pack("<Q", 2 ** 60) + b"{}")
    assert main(args + [str(tmp_path / "trunc")]) == 2
    assert "not a readable safetensors file" in _line(capsys, "capture")


def test_capture_arguments_out_of_range_are_bad_input(tmp_path, closed_url, capsys):
    _ckpt(tmp_path / "train", {"input_ids": torch.arange(5), "aux_hidden_state": AUX})
    args = ["capture", "--url", closed_url, "--training", str(tmp_path / "train"), "--num-samples", "1"]
    assert main(args + ["--hidden-size", "-16"]) == 2
    assert "--hidden-size must be >= 1, got -16" in _line(capsys, "capture")
    f = tmp_path / "file"
    f.write_text("x")
    assert main(args + ["--every-layer", str(f)]) == 2
    assert f"{f}: --every-layer must be the folder" in _line(capsys, "capture")
    assert main(args + ["--timeout", "nan"]) == 2
    _line(capsys, "capture")


def test_an_empty_rows_value_is_bad_input_naming_the_flag():
    from helpers.cli.common import rows_arg
    from helpers.errors import BadInput

    for value in ("", " , "):
        with pytest.raises(BadInput, match=r"\[--rows\].*names nothing"):
            rows_arg(value)
    assert rows_arg("greedy, validation") == ("validation", "greedy")
    for value, what in (("validation,training", "two splits"), ("sampled,greedy", "two text kinds")):
        with pytest.raises(BadInput, match=rf"\[--rows\].*{what}"):
            rows_arg(value)


def test_compare_engines_checks_both_urls_before_any_request(capsys):
    from helpers.cli.compare_engines import cli_main

    assert cli_main(["--a", "http://127.0.0.1:1", "--b", "notaurl", "--training", "env/models/data/sample",
                     "--out", "/nonexistent-e3f-should-not-be-made"]) == 2
    err = capsys.readouterr().err.strip()
    assert "[--b]" in err and "http://host:port" in err and "\n" not in err
