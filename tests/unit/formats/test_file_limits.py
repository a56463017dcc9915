"""User-named files are read with limits (issue 40): a FIFO, ``/dev/zero``, a socket or a symlink loop given for a
file is refused at once, naming the file and what it is; a file over its size limit is refused naming both sizes; a
5000-digit integer is BadInput naming the file; FP8 training or served states are refused naming the file and the
tensor. Every special file here is made by the test; a read that blocked would hang the test (the FIFO has no
writer), so each case runs under a short alarm."""
from __future__ import annotations

import json
import os
import signal
import socket

import pytest
import torch
from safetensors.torch import save_file

from helpers.errors import BadInput
from helpers.formats.configs import MAX_CONFIG_BYTES, read_config_json, read_safetensors_index
from helpers.formats.dumps import read_dump, safe_torch_load, write_dump
from helpers.formats.training_data import TrainingData, read_ckpt_sample, read_speculators_sample
from helpers.runfiles import load_yaml_model, load_yaml_text, read_file_bytes, read_json_file
from helpers.acceptance.prompts import load_prompts
from helpers.draft.training_log import read_training_log

H = 16


@pytest.fixture(autouse=True)
def _no_hang():
    """A blocking open or read fails the test after 10 s instead of hanging it."""
    def boom(*_):
        raise TimeoutError("a reader blocked on a special file")
    old = signal.signal(signal.SIGALRM, boom)
    signal.alarm(10)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


@pytest.fixture
def specials(tmp_path):
    """{name: path} of special files that are no regular file."""
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(tmp_path / "sock"))
    (tmp_path / "zero").symlink_to("/dev/zero")
    yield {"fifo": (tmp_path / "fifo", "a FIFO (named pipe)"), "zero": (tmp_path / "zero", "a character device"),
           "sock": (tmp_path / "sock", "a socket"), "loop": (tmp_path / "loop", "Too many levels of symbolic links")}
    sock.close()


@pytest.mark.parametrize("kind", ["fifo", "zero", "sock", "loop"])
def test_special_files_are_refused_naming_the_file_and_what_it_is(kind, specials):
    path, what = specials[kind]
    for read, word in ((lambda p: read_json_file(p, "manifest"), "manifest"),
                       (lambda p: read_config_json(p, "target config"), "target config"),
                       (lambda p: load_yaml_model(p, dict, what="fixes file"), "fixes file"),
                       (lambda p: load_prompts(p), "prompt file"),
                       (lambda p: read_training_log(p), "training log")):
        with pytest.raises(BadInput) as e:
            read(path)
        assert str(e.value).startswith(f"{path}: "), str(e.value)
        assert word in str(e.value) and what in str(e.value), str(e.value)


@pytest.mark.parametrize("kind", ["fifo", "zero", "loop"])
def test_tensor_files_that_are_special_files_are_refused_before_opening(kind, specials, tmp_path):
    path, what = specials[kind]
    for name, read in (("data_0.ckpt", safe_torch_load), ("hs_0.safetensors", read_speculators_sample),
                       ("model.safetensors", read_safetensors_index)):
        link = tmp_path / f"{kind}-{name}"
        link.symlink_to(path)
        with pytest.raises(BadInput) as e:
            read(link)
        if kind == "loop" and read is read_safetensors_index:    # globbed like a missing file
            assert str(e.value) == f"{link}: no draft weights found (expected *.safetensors or model.safetensors." \
                                   "index.json)"
            continue
        assert str(e.value).startswith(f"{link}: ") and what in str(e.value), str(e.value)
    # issue 40: a sample that is a special file is refused naming it (it was dropped without a word), never opened --
    # alone in its folder, beside a real sample, or named itself
    train = tmp_path / "train" / "rows_0-2000"
    train.mkdir(parents=True)
    torch.save({"input_ids": torch.arange(6), "loss_mask": torch.ones(6), "hidden_state": torch.ones(1, 6, H),
                "aux_hidden_state": torch.ones(1, 6, 3 * H)}, train / "data_1.ckpt")
    (train / "data_0.ckpt").symlink_to(path)
    for given in (tmp_path / "train", train, train / "data_0.ckpt"):
        with pytest.raises(BadInput) as e:
            TrainingData(given)
        assert str(e.value).startswith(f"{train / 'data_0.ckpt'}: ") and "training " in str(e.value), str(e.value)
        assert what in str(e.value), str(e.value)


@pytest.mark.parametrize("kind", ["fifo", "zero", "loop"])
def test_special_files_among_the_inputs_are_named_as_what_they_are(kind, specials, tmp_path, capsys):
    """Issue 40: a ``capture.json`` that is a FIFO or /dev/zero was taken for "no record" (the layer plan fell back
    to inferred ids); ``--training-log`` of one said "not found", ``--served /dev/zero`` "empty file", ``capture
    --training FIFO`` "no training files found": each is named as what it is, through the one reader rule."""
    from helpers.__main__ import main
    from helpers.draft.training_log import find_training_log
    from helpers.formats.dumps import load_served
    from helpers.formats.rows import data_manifest
    path, what = specials[kind]
    data = tmp_path / "data"
    data.mkdir()
    (data / "capture.json").symlink_to(path)
    with pytest.raises(BadInput) as e:
        data_manifest(data)
    assert str(e.value).startswith(f"{data / 'capture.json'}: ") and "capture.json" in str(e.value) and what in str(e.value), str(e.value)
    with pytest.raises(BadInput) as e:
        find_training_log(tmp_path, path)
    assert str(e.value).startswith(f"{path} [--training-log]: ") and "training log" in str(e.value) and what in str(e.value), str(e.value)
    with pytest.raises(BadInput) as e:
        load_served(path)
    assert str(e.value).startswith(f"{path}: ") and "served data" in str(e.value) and what in str(e.value), str(e.value)
    capsys.readouterr()
    assert main(["capture", "--url", "http://127.0.0.1:1", "--training", str(path), "--num-samples", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"capture: error: {path}") and what in err and "\n" not in err, err


def test_a_file_over_its_limit_is_refused_naming_both_sizes(tmp_path):
    big = tmp_path / "config.json"
    big.write_text('{"pad": "' + "x" * (MAX_CONFIG_BYTES + 10) + '"}')
    with pytest.raises(BadInput, match=r"config\.json: target config is 4\.0 MiB, over the limit of 4 MiB"):
        read_config_json(tmp_path, "target config")
    assert read_json_file(big, "manifest")["pad"].startswith("xxx")     # the general limit (64 MiB) takes it
    with pytest.raises(BadInput, match=r"over the limit of 0 MiB"):
        read_file_bytes(big, "manifest", max_bytes=1000)
    assert read_file_bytes(big, "manifest", max_bytes=MAX_CONFIG_BYTES + 100)[:9] == b'{"pad": "'


def test_a_5000_digit_integer_is_bad_input_naming_the_file(tmp_path):
    f = tmp_path / "config.json"
    f.write_text('{"hidden_size": ' + "9" * 5000 + "}")
    with pytest.raises(BadInput, match=rf"^{f}: target config holds an integer of more than 4300 digits"):
        read_config_json(f, "target config")
    y = tmp_path / "fixes.yaml"
    y.write_text("fixes:\n  - name: a\n    port: " + "9" * 5000 + "\n")
    with pytest.raises(BadInput, match=rf"^{y}: fixes file holds an integer of more than 4300 digits"):
        load_yaml_model(y, dict, what="fixes file")
    with pytest.raises(BadInput, match="integer of more than 4300 digits"):
        load_yaml_text("a: " + "1" * 5000, "params file")
    p = tmp_path / "prompts.json"
    p.write_text('[{"input_ids": [' + "1" * 5000 + "]}]")
    with pytest.raises(BadInput, match=rf"^{p}: holds an integer of more than 4300 digits"):
        load_prompts(p)


FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


@pytest.mark.parametrize("dtype", FP8, ids=str)
def test_fp8_training_states_are_refused_naming_file_and_tensor(dtype, tmp_path):
    f = tmp_path / "hs_0.safetensors"
    save_file({"token_ids": torch.arange(5), "hidden_states": torch.ones(5, 3, H).to(dtype)}, str(f))
    name = str(dtype).replace("torch.", "")
    with pytest.raises(BadInput, match=rf"^{f} \[hidden_states\]: dtype {name}: not plain float hidden states"):
        read_speculators_sample(f)
    c = tmp_path / "data_0.ckpt"
    torch.save({"input_ids": torch.arange(5), "aux_hidden_state": torch.ones(1, 5, 3 * H).to(dtype)}, c)
    with pytest.raises(BadInput, match=rf"^{c} \[aux_hidden_state\]: dtype {name}: not plain float"):
        read_ckpt_sample(c)
    torch.save({"input_ids": torch.arange(5), "aux_hidden_state": torch.ones(1, 5, 3 * H),
                "hidden_state": torch.ones(1, 5, H).to(dtype)}, c)
    with pytest.raises(BadInput, match=rf"^{c} \[hidden_state\]: dtype {name}: not plain float"):
        read_ckpt_sample(c)
    d = write_dump(tmp_path / "dump", [{"key": "s0", "input_ids": torch.arange(5),
                                        "hidden": torch.ones(5, 3 * H).to(dtype)}], {"kind": "served", "hidden_size": H})
    with pytest.raises(BadInput, match=rf"tensors\.safetensors \[s0/hidden\]: dtype F8_E[45]M[32]: not plain float"):
        read_dump(d)
    # the same states in bfloat16 are read (the refusal is of the dtype, not of the shapes)
    save_file({"token_ids": torch.arange(5), "hidden_states": torch.ones(5, 3, H, dtype=torch.bfloat16)}, str(f))
    assert read_speculators_sample(f).width == 2 * H


def test_the_cli_names_fp8_states_in_one_line(tmp_path, capsys):
    from helpers.__main__ import main
    (tmp_path / "hs").mkdir()
    f = tmp_path / "hs" / "hs_0.safetensors"
    save_file({"token_ids": torch.arange(5), "hidden_states": torch.ones(5, 3, H).to(torch.float8_e4m3fn)}, str(f))
    assert main(["capture", "--url", "http://127.0.0.1:1", "--training", str(tmp_path / "hs"),
                 "--num-samples", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"capture: error: {f} [hidden_states]: dtype float8_e4m3fn") and "\n" not in err, err
    assert json.dumps(err)      # one printable line
