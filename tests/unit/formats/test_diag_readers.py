"""Readers: draft/target configs, draft weights, training data (safe loading), dumps, /generate responses,
SGLang dumper files. Every error must name the file/field and what was expected."""
from __future__ import annotations

import gzip
import io
import json
import os
import pickle

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from helpers.formats.configs import read_config_json, read_draft_config, read_draft_weights, read_target_config
from helpers.server.settings import ServerSettings
from helpers.formats.dumps import (read_dump, read_dumper_dir, read_generate_response, safe_torch_load, samples_from_generate,
                           write_dump)
from helpers.errors import BadInput
from helpers.formats.training_data import TrainingData, read_ckpt_sample, read_speculators_sample
from support.tinymodels import build_eagle3_draft


# ------------------------------------------------------------------------------------------------ configs

def test_read_config_json_names_the_file(tmp_path, tiny_target):
    raw = json.loads((tiny_target / "config.json").read_text())
    assert read_config_json(tiny_target)["hidden_size"] == raw["hidden_size"]
    with pytest.raises(BadInput, match=r"draft config not found .*config\.json"):
        read_config_json(tmp_path, "draft config")
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(BadInput, match=r"config\.json.*expected a JSON object, got list"):
        read_config_json(tmp_path / "config.json", "target config")


def test_every_config_json_read_goes_through_formats_configs():
    """No module of helpers parses a config.json itself: formats.configs.read_config_json is the one reader (its
    error contract: BadInput naming the file)."""
    import ast
    from support import ROOT
    parsers = {"loads", "loads_json", "read_json_file", "read_text", "load"}
    bad = []
    for path in (ROOT / "helpers").rglob("*.py"):
        if path.name == "configs.py" and path.parent.name == "formats":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) in parsers:
                text = ast.unparse(node)
                if "config.json" in text:
                    bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: {text}")
    assert not bad, "config.json parsed outside helpers.formats.configs:\n" + "\n".join(bad)

def test_draft_config_forms(tmp_path, tiny_target, tiny_draft):
    d = read_draft_config(tiny_draft)
    assert (d.form, d.nested_layer_ids, d.top_level_layer_ids, d.hidden_size) == ("sglang", (1, 3, 4), None, 64)
    assert (d.sglang_num_aux, d.sglang_fc_in_features, d.draft_vocab_size) == (3, 192, 256)
    top = read_draft_config(build_eagle3_draft(tmp_path / "top", tiny_target, layer_ids=[1, 3, 5], nested=False))
    assert (top.nested_layer_ids, top.top_level_layer_ids) == (None, (1, 3, 5))
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"],
                                "transformer_layer_config": {"hidden_size": 4096, "vocab_size": 128256,
                                                             "model_type": "llama"},
                                "draft_vocab_size": 32000, "target_hidden_size": 4096,
                                "eagle_aux_hidden_state_layer_ids": [2, 16, 29]}))
    s = read_draft_config(spec)
    assert (s.form, s.top_level_layer_ids, s.nested_layer_ids, s.hidden_size) == ("speculators", (2, 16, 29), None, 4096)
    eagle = tmp_path / "eagle.json"
    eagle.write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "draft_vocab_size": 32000,
                                 "vocab_size": 128256}))
    assert read_draft_config(eagle).form == "eagle"


@pytest.mark.parametrize("content,needle", [
    ("", "empty"), ("{not json", "not valid JSON"), ("[1, 2]", "expected a JSON object"),
    ('{"architectures": ["LlamaForCausalLMEagle3"]}', "[hidden_size]"),
    ('{"hidden_size": 64, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, "3"]}}',
     "[eagle_config.eagle_aux_hidden_state_layer_ids]"),
    ('{"hidden_size": 64, "eagle_config": [1]}', "[eagle_config]"),
    ('{"architectures": [1, 2], "hidden_size": 64}', "[architectures]: expected a list of architecture names"),
    ('{"architectures": "LlamaForCausalLMEagle3", "hidden_size": 64}', "[architectures]"),
    ('{"hidden_size": 64, "model_type": 5}', "[model_type]: expected a string"),
    ('{"hidden_size": 64, "x": ' + "[" * 100000 + "]" * 100000 + "}", "nests arrays/objects too deeply"),
])
def test_draft_config_errors_name_file_and_field(tmp_path, content, needle):
    p = tmp_path / "config.json"
    p.write_text(content)
    with pytest.raises(BadInput) as e:
        read_draft_config(p)
    assert str(p) in str(e.value) and needle in str(e.value)


def test_draft_weights(tmp_path, tiny_target, tiny_draft):
    w = read_draft_weights(tiny_draft)
    assert (w.fc_shape, w.d2t_shape, w.t2d_shape, w.lm_head_shape) == ((64, 192), (256,), (384,), (256, 64))
    nod2t = read_draft_weights(build_eagle3_draft(tmp_path / "n", tiny_target, with_d2t=False))
    assert nod2t.d2t_shape is None
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage")
    with pytest.raises(BadInput, match="not a readable safetensors"):
        read_draft_weights(bad)


def test_target_config_text_config(tmp_path, tiny_target):
    t = read_target_config(tiny_target)
    assert (t.hidden_size, t.num_hidden_layers, t.vocab_size, t.family) == (64, 8, 384, "plus_one")
    kimi = tmp_path / "kimi.json"
    kimi.write_text(json.dumps({"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
                                "text_config": {"hidden_size": 7168, "num_hidden_layers": 61, "vocab_size": 163840,
                                                "torch_dtype": "bfloat16"}}))
    k = read_target_config(kimi)
    assert (k.hidden_size, k.num_hidden_layers, k.family, k.torch_dtype) == (7168, 61, "deepseek", "bfloat16")
    kimi.write_text(json.dumps({"text_config": {"hidden_size": 7168}}))
    with pytest.raises(BadInput, match=r"\[text_config.num_hidden_layers\]"):
        read_target_config(kimi)
    # a bad value inside the text sub-config is named with its sub-config
    kimi.write_text(json.dumps({"text_config": {"hidden_size": "x", "num_hidden_layers": 48}}))
    with pytest.raises(BadInput, match=r"\[text_config.hidden_size\]: expected a positive integer, got 'x'"):
        read_target_config(kimi)


@pytest.mark.parametrize("content,needle", [
    ({"architectures": "LlamaForCausalLM", "hidden_size": 64, "num_hidden_layers": 8},
     "[architectures]: expected a list of architecture names (strings), got 'LlamaForCausalLM'"),
    ({"architectures": [None], "hidden_size": 64, "num_hidden_layers": 8}, "[architectures]"),
    ({"architectures": ["LlamaForCausalLM"], "model_type": 5, "hidden_size": 64, "num_hidden_layers": 8},
     "[model_type]: expected a string, got 5"),
])
def test_target_config_errors_name_file_and_field(tmp_path, content, needle):
    p = tmp_path / "config.json"
    p.write_text(json.dumps(content))
    with pytest.raises(BadInput) as e:
        read_target_config(p)
    assert str(e.value) == f"{p} {needle}" or (str(p) in str(e.value) and needle in str(e.value))
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100000 + "]" * 100000)
    with pytest.raises(BadInput, match="too deeply"):
        read_target_config(deep)


def test_server_settings():
    s = ServerSettings.from_dict({"speculative_algorithm": "eagle3", "speculative_num_steps": 3,
                                  "speculative_eagle_topk": 1, "speculative_num_draft_tokens": 4, "tp_size": 8,
                                  "version": "0.5.23"})
    assert (s.algorithm, s.num_draft_tokens, s.tp_size, s.parsed_version) == ("EAGLE3", 4, 8, (0, 5, 23))
    with pytest.raises(BadInput, match="speculative_num_steps"):
        ServerSettings.from_dict({"speculative_num_steps": "3"})


# ----------------------------------------------------------------------------------------- training data

def _specforge_record(L=6, pad=2, H=8, dtype=torch.bfloat16):
    ids = torch.tensor(list(range(5, 5 + L)) + [0] * pad)
    lm = torch.tensor([0, 0] + [1] * (L - 2) + [0] * pad)
    aux = torch.randn(1, L + pad, 3 * H).to(dtype)
    return {"input_ids": ids, "loss_mask": lm, "aux_hidden_state": aux, "hidden_state": torch.randn(1, L + pad, H)}


def test_specforge_ckpt_and_gz(tmp_path):
    rec = _specforge_record()
    d = tmp_path / "rows_0-2000"
    d.mkdir()
    torch.save(rec, d / "data_10.ckpt")
    buf = io.BytesIO()
    torch.save(rec, buf)
    with gzip.open(d / "data_2.ckpt.gz", "wb") as f:
        f.write(buf.getvalue())
    s = read_ckpt_sample(d / "data_10.ckpt")
    assert (s.rows, s.width, s.dtype, s.meta["hidden_size"], s.meta["padded_len"]) == (6, 24, "bfloat16", 8, 8)
    assert torch.equal(s.load(), rec["aux_hidden_state"][0, :6])
    td = TrainingData(tmp_path)
    assert [x.sample_id for x in td] == ["data_2", "data_10"]          # natural order of the index
    assert (td.sample_layout, td.hidden_size, td.num_chunks) == ("specforge", 8, 3)
    with pytest.raises(BadInput, match="not a multiple of the target hidden size 7"):
        read_ckpt_sample(d / "data_10.ckpt", hidden_size=7)


def test_speculators_and_eagle12(tmp_path):
    L, H = 5, 8
    hs = torch.randn(L, 4, H)
    save_file({"token_ids": torch.arange(L), "hidden_states": hs}, str(tmp_path / "hs_0.safetensors"))
    s = read_speculators_sample(tmp_path / "hs_0.safetensors")
    assert (s.width, s.meta["num_chunks"], s.meta["slots"]) == (3 * H, 3, 4)
    assert torch.equal(s.load(), hs[:, :3].reshape(L, 3 * H))            # training drops the last slot
    save_file({"token_ids": torch.arange(L)}, str(tmp_path / "hs_1.safetensors"))
    with pytest.raises(BadInput, match=r"\[hidden_states\]"):
        read_speculators_sample(tmp_path / "hs_1.safetensors")
    e = tmp_path / "e"
    e.mkdir()
    torch.save({"input_ids": torch.arange(L), "hidden_state": torch.randn(L, H), "loss_mask": torch.ones(L)},
               e / "data_0.ckpt")
    s = read_ckpt_sample(e / "data_0.ckpt")
    assert (s.meta["layout"], s.meta["num_chunks"], s.width) == ("eagle12", 1, H)


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


@pytest.mark.parametrize("how", ["torch.save", "pickle.dump"])
def test_pickled_payload_is_refused_not_executed(tmp_path, how):
    marker = str(tmp_path / "PWNED")
    p = tmp_path / "data_0.ckpt"
    payload = {"input_ids": torch.arange(3), "aux_hidden_state": torch.zeros(1, 3, 6), "evil": _Payload(marker)}
    if how == "torch.save":
        torch.save(payload, p)
    else:
        with open(p, "wb") as f:
            pickle.dump(payload, f)
    with pytest.raises(BadInput, match="refused.*NOT executed") as e:
        read_ckpt_sample(p)
    assert str(p) in str(e.value)
    assert not os.path.exists(marker)
    if how == "pickle.dump":   # the payload is live: a plain unpickler would have run it
        with open(p, "rb") as f:
            pickle.load(f)
        assert os.path.exists(marker)


def test_truncated_corrupt_and_empty_training_files(tmp_path):
    good = tmp_path / "good.ckpt"
    torch.save(_specforge_record(), good)
    data = good.read_bytes()
    trunc = tmp_path / "data_1.ckpt"
    trunc.write_bytes(data[: len(data) // 2])
    with pytest.raises(BadInput, match="truncated or corrupt"):
        read_ckpt_sample(trunc)
    gz = tmp_path / "data_2.ckpt.gz"
    gz.write_bytes(b"\x1f\x8b\x08\x00garbage")
    with pytest.raises(BadInput, match="truncated or corrupt"):
        read_ckpt_sample(gz)
    empty = tmp_path / "data_3.ckpt"
    empty.write_bytes(b"")
    with pytest.raises(BadInput, match="empty file"):
        safe_torch_load(empty)
    torch.save({"input_ids": torch.arange(3)}, tmp_path / "data_4.ckpt")
    with pytest.raises(BadInput, match=r"\[aux_hidden_state\]"):
        read_ckpt_sample(tmp_path / "data_4.ckpt")
    torch.save({"input_ids": torch.arange(3), "aux_hidden_state": torch.zeros(1, 4, 6)}, tmp_path / "data_5.ckpt")
    with pytest.raises(BadInput, match="4 rows but 3 input_ids"):
        read_ckpt_sample(tmp_path / "data_5.ckpt")


# ------------------------------------------------------------------------------------------------ dumps

def test_dump_round_trip_atomic_never_overwrite(tmp_path):
    samples = [{"key": "a", "sample_id": "data_0", "input_ids": [5, 6, 7], "hidden": torch.randn(3, 12).bfloat16(),
                "output_ids": [9, 8], "num_prompt_tokens": 2},
               {"key": "b", "input_ids": np.array([1, 2]), "hidden": torch.randn(2, 12).bfloat16(), "first_position": 4}]
    p = write_dump(tmp_path / "d", samples, {"kind": "served", "hidden_size": 4, "tp_rank": 1, "tp_size": 2,
                                             "server": {"speculative_algorithm": "EAGLE3"}})
    src = read_dump(p)
    assert (src.kind, src.hidden_size, src.dtype, src.tp_rank, src.width) == ("served", 4, "bfloat16", 1, 12)
    a, b = src.samples
    assert torch.equal(a.load(), samples[0]["hidden"]) and a.output_ids == [9, 8] and a.sample_id == "data_0"
    assert (b.first_position, list(b.input_ids)) == (4, [1, 2])
    with pytest.raises(FileExistsError):
        write_dump(tmp_path / "d", samples, {})
    with pytest.raises(ValueError, match="rows but"):
        write_dump(tmp_path / "e", [{"key": "x", "input_ids": [1], "hidden": torch.zeros(2, 4)}], {})
    assert sorted(x.name for x in tmp_path.iterdir()) == ["d"]            # no temp folder left behind
    # corrupt manifest / tensors
    (p / "manifest.json").write_text(json.dumps({**json.loads((p / "manifest.json").read_text()), "width": "x"}))
    with pytest.raises(BadInput, match=r"\[width\]"):
        read_dump(p)


def test_dump_truncated_tensors(tmp_path):
    p = write_dump(tmp_path / "d", [{"key": "a", "input_ids": [1, 2], "hidden": torch.randn(2, 4)}], {})
    t = p / "tensors.safetensors"
    t.write_bytes(t.read_bytes()[:40])
    with pytest.raises(BadInput, match="corrupt or truncated"):
        read_dump(p)


def _resp(P=3, W=4, n_out=3, **kw):
    rows = np.arange((P + n_out - 1) * W, dtype=np.float32).reshape(-1, W)
    r = {"text": "", "output_ids": list(range(100, 100 + n_out)),
         "meta_info": {"id": "r1", "prompt_tokens": P, "completion_tokens": n_out,
                       "hidden_states": [rows[:P].tolist()] + rows[P:].tolist()},
         "prompt_token_ids": [7, 8, 9][:P]}
    r.update(kw)
    return r, rows


def test_generate_response_layout(tmp_path):
    r, rows = _resp()
    (s,) = samples_from_generate(r)
    assert s.rows == 5 and list(s.input_ids) == [7, 8, 9, 100, 101] and s.first_position == 0
    assert torch.equal(s.load(), torch.from_numpy(rows))
    # cached prefix: the prompt block holds only the suffix rows
    r2 = json.loads(json.dumps(r))
    r2["meta_info"]["hidden_states"][0] = r2["meta_info"]["hidden_states"][0][1:]
    (s2,) = samples_from_generate(r2)
    assert (s2.first_position, list(s2.input_ids)) == (1, [8, 9, 100, 101])
    # no prompt ids: unknown ids, P from meta_info.prompt_tokens
    r3 = {k: v for k, v in r.items() if k != "prompt_token_ids"}
    (s3,) = samples_from_generate(r3)
    assert s3.input_ids is None and s3.num_prompt_tokens == 3
    # orjson writes NaN as null
    r4 = json.loads(json.dumps(r))
    r4["meta_info"]["hidden_states"][2][1] = None
    (s4,) = samples_from_generate(r4)
    assert torch.isnan(s4.load()[4, 1]) and torch.isfinite(s4.load()[3]).all()


@pytest.mark.parametrize("mutate,needle", [
    (lambda r: r["meta_info"].pop("hidden_states"), "--enable-return-hidden-states"),
    (lambda r: r["meta_info"].__setitem__("hidden_states", []), "empty hidden_states"),
    (lambda r: r["meta_info"].__setitem__("hidden_states", [[0.0, 1.0]]), "'last'"),
    (lambda r: r["meta_info"]["hidden_states"].pop(), "decode rows but 3 output_ids"),
    (lambda r: r["meta_info"]["hidden_states"][0].__setitem__(1, [1.0]), "rectangular"),
    (lambda r: r["meta_info"].__setitem__("prompt_tokens", 1) or r.pop("prompt_token_ids"), "prompt has 1 tokens"),
])
def test_generate_response_errors(tmp_path, mutate, needle):
    r, _ = _resp()
    mutate(r)
    p = tmp_path / "r.json"
    p.write_text(json.dumps([r]))
    with pytest.raises(BadInput) as e:
        read_generate_response(p)
    assert needle in str(e.value) and str(p) in str(e.value)


def test_generate_response_file_errors(tmp_path):
    p = tmp_path / "r.json"
    p.write_text("")
    with pytest.raises(BadInput, match="empty file"):
        read_generate_response(p)
    r, _ = _resp()
    p.write_text(json.dumps(r)[:-20])
    with pytest.raises(BadInput, match="not valid JSON, or truncated"):
        read_generate_response(p)


def test_sglang_dumper_files(tmp_path):
    # format of sglang/srt/debug_utils/dumper.py::_Dumper._dump_single (0.5.23)
    exp = tmp_path / "dump_20260101" / "exp"
    exp.mkdir(parents=True)
    ids = torch.tensor([5, 6, 7, 8, 9, 10, 11])
    pos = torch.tensor([0, 1, 2, 3, 0, 1, 2])        # two requests in one extend batch
    for rank in (0, 1):
        val = torch.randn(7, 12)
        for k, (name, v) in enumerate([("input_ids", ids), ("positions", pos), ("aux_hidden_states", val)]):
            meta = {"step": 3, "rank": rank, "dump_index": k + 1, "name": name, "world_rank": rank, "world_size": 2,
                    "sglang_parallel_info": {"tp_rank": rank, "tp_size": 2, "pp_rank": 0, "pp_size": 1}}
            fn = f"step=3___rank={rank}___dump_index={k + 1}___name={name}___recompute_status=disabled.pt"
            torch.save({"value": v, "meta": meta}, exp / fn)
    srcs = read_dumper_dir(tmp_path / "dump_20260101")
    assert [s.tp_rank for s in srcs] == [0, 1] and all(s.tp_size == 2 for s in srcs)
    a, b = srcs[0].samples
    assert (a.rows, b.rows, b.first_position, list(b.input_ids)) == (4, 3, 0, [9, 10, 11])
    with pytest.raises(BadInput, match="no dumper record named 'nope'"):
        read_dumper_dir(exp, name="nope")
    # a dumper file with an object payload is refused
    torch.save({"value": _Payload(str(tmp_path / "x")), "meta": {}}, exp / "step=4___rank=0___name=evil.pt")
    with pytest.raises(BadInput, match="refused"):
        read_dumper_dir(exp)
    assert not (tmp_path / "x").exists()
