"""An EAGLE-1 draft (vLLM 0.32.0 ``method: eagle``, ``EagleLlamaForCausalLM``) run offline (helpers/draft/eagle1.py):
its logits equal a straightforward reimplementation of ``vllm/model_executor/models/llama_eagle.py::LlamaModel.
forward`` built from transformers' own ``LlamaDecoderLayer`` (layer 0's input_layernorm an Identity, no final norm,
the target's tied lm_head) on the llama_h64 target's real post-norm hidden states; the load_draft seam picks it from
the config's architectures; the decode step equals the extend row; the drafting replay runs it; a missing tensor is
one BadInput line."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from helpers.draft.eagle1 import Eagle1Draft, eagle1_tensor_names
from helpers.draft.loader import load_draft
from helpers.draft.simulate import DraftSettings, SimSequence, simulate_sequences
from helpers.errors import BadInput
from support import ROOT

H64 = ROOT / "env" / "models" / "llama_h64"
TARGET = H64 / "target"
TRAINED = H64 / "draft_eagle1"


def _config(layers: int) -> dict:
    t = json.loads((TARGET / "config.json").read_text())
    keep = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "hidden_act", "max_position_embeddings", "rms_norm_eps", "rope_parameters", "vocab_size")
    return {"architectures": ["EagleLlamaForCausalLM"], "model_type": "llama", **{k: t[k] for k in keep},
            "num_hidden_layers": layers, "tie_word_embeddings": False}


def _random_draft(out, layers: int, seed: int = 0, drop: str | None = None):
    """A draft folder with N(0, 0.05) matrices and 1 + N(0, 0.1) norms in float32; ``drop``: a name left out."""
    out.mkdir(parents=True, exist_ok=True)
    cfg = _config(layers)
    (out / "config.json").write_text(json.dumps(cfg))
    g = torch.Generator().manual_seed(seed)
    w = {}
    for name, shape in eagle1_tensor_names(cfg).items():
        w[name] = (1 + 0.1 * torch.randn(shape, generator=g)) if len(shape) == 1 else 0.05 * torch.randn(
            shape, generator=g)
    if drop:
        w.pop(drop)
    save_file(w, str(out / "model.safetensors"))
    return out


@pytest.fixture(scope="module")
def target():
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(str(TARGET), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def seq(target):
    d = torch.load(H64 / "data" / "sample" / "rows_0-2000" / "data_0.ckpt", weights_only=True)
    ids = d["input_ids"].reshape(-1)[:65]
    with torch.no_grad():
        hid = target.model(input_ids=ids[None]).last_hidden_state[0]      # post-final-norm, what vLLM feeds
    return ids, hid


def _reference(folder, target, ids: torch.Tensor, hid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """llama_eagle.py's forward written with transformers' modules: fc(cat(embed, h)) -> LlamaDecoderLayers (layer 0
    without input_layernorm) -> out (no norm) -> target lm_head. Row t: token ids[t+1], state hid[t]."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding
    cfg = json.loads((folder / "config.json").read_text())
    hc = LlamaConfig(**{k: v for k, v in cfg.items() if k != "architectures"})
    hc._attn_implementation = "eager"
    w = {k: v.float() for k, v in load_file(str(folder / "model.safetensors")).items()}
    layers = nn.ModuleList([LlamaDecoderLayer(hc, i) for i in range(hc.num_hidden_layers)])
    layers[0].input_layernorm = nn.Identity()
    layers.load_state_dict({k[len("layers."):]: v for k, v in w.items() if k.startswith("layers.")})
    T = hid.shape[0]
    pos = torch.arange(T)[None]
    mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        x = F.linear(torch.cat([target.model.embed_tokens(ids[1:T + 1]), hid], -1), w["fc.weight"])[None]
        pe = LlamaRotaryEmbedding(hc)(x, pos)
        for layer in layers:
            x = layer(x, attention_mask=mask, position_ids=pos, position_embeddings=pe)
            x = x[0] if isinstance(x, tuple) else x
        return x[0], target.lm_head(x[0])


@pytest.mark.parametrize("layers", [1, 2, "trained"])
def test_eagle1_equals_the_transformers_reimplementation(layers, tmp_path, target, seq):
    """Logits and carried hidden state of the offline run equal the reference to 1e-5 (float32), loaded through the
    load_draft seam (architectures EagleLlamaForCausalLM); the lm_head and embedding are the target's. ``trained``:
    the committed llama_h64 draft (bf16 weights upcast)."""
    if layers == "trained" and not (TRAINED / "config.json").is_file():
        pytest.skip("no trained EAGLE-1 draft")
    folder = TRAINED if layers == "trained" else _random_draft(tmp_path / "d", layers)
    ids, hid = seq
    d = load_draft(folder, TARGET)
    assert isinstance(d, Eagle1Draft)
    T = ids.shape[0] - 1
    ext = d.extend(ids[1:T + 1], hid[:T])
    ref_h, ref_l = _reference(folder, target, ids, hid[:T])
    assert (ext.hidden - ref_h).abs().max() < 1e-5
    assert (ext.logits - ref_l).abs().max() < 1e-5
    assert ext.logits.shape == (T, 4096) and ref_l.std() > 0.1      # not a degenerate comparison


def test_decode_step_equals_the_extend_row(tmp_path, seq):
    """A draft decode step for row t (extend rows 0..t-1 as context, itself last) equals the extend's row t."""
    d = load_draft(_random_draft(tmp_path / "d", 1), TARGET)
    ids, hid = seq
    T = ids.shape[0] - 1
    ext = d.extend(ids[1:T + 1], hid[:T])
    rows = torch.tensor([5, 20, T - 1])
    hidden, logits, _ = d.step(ids[rows + 1], d.project(hid[rows]), rows, rows, ext)
    assert (logits - ext.logits[rows]).abs().max() < 1e-4
    assert (hidden - ext.hidden[rows]).abs().max() < 1e-5


@pytest.mark.skipif(not (TRAINED / "config.json").is_file(), reason="no trained EAGLE-1 draft")
def test_trained_draft_replays_above_chance(seq):
    """The trained llama_h64 EAGLE-1 draft in the drafting replay: step-1 marginal equals the extend argmax hit rate
    against the token two ahead, well above chance (1/4096), and chain accept lengths lie in [1, steps + 1]."""
    d = load_draft(TRAINED, TARGET)
    ids, hid = seq
    T = ids.shape[0]
    res = simulate_sequences(d, [SimSequence("s0", ids, hid[:T - 1], start=16)],
                             [DraftSettings.chain(1), DraftSettings.chain(3)])
    ext = d.extend(ids[1:], hid[:T - 1])
    r = torch.arange(15, T - 2)
    direct = (ext.logits[r].argmax(-1) == ids[r + 2]).float().mean().item()
    assert res["marginal"][0] == pytest.approx(direct)
    assert direct > 0.2
    for st, frame in res["per_request"].items():
        row = frame.iloc[0]
        assert row["verify_ct"] > 0 and 1.0 <= row["accept_length"] <= st.steps + 1, (st, row)


def test_missing_tensor_is_one_badinput_line(tmp_path):
    folder = _random_draft(tmp_path / "d", 1, drop="layers.0.mlp.up_proj.weight")
    with pytest.raises(BadInput) as e:
        load_draft(folder, TARGET)
    msg = str(e.value)
    assert "\n" not in msg and "layers.0.mlp.up_proj.weight" in msg and "uninitialised" in msg


def test_target_folder_is_required(tmp_path):
    with pytest.raises(BadInput, match="lm_head"):
        load_draft(_random_draft(tmp_path / "d", 1), None)


def _with_extra(tmp_path, extra: dict):
    """A copy of the trained EAGLE-1 draft with ``extra`` tensors added to its safetensors."""
    d = tmp_path / "d"
    d.mkdir()
    (d / "config.json").write_text((TRAINED / "config.json").read_text())
    w = load_file(str(TRAINED / "model.safetensors"))
    save_file({**w, **extra}, str(d / "model.safetensors"))
    return d, w


@pytest.mark.parametrize("name", ["norm.weight", "lm_head.weight", "layers.1.post_attention_layernorm.weight",
                                  "fc.weight_scale"])
def test_a_tensor_vllm_has_no_parameter_for_is_refused(tmp_path, name):
    """vLLM 0.32.0's AutoWeightsLoader raises for them (checked by running it on the draft's module names)."""
    H = json.loads((TRAINED / "config.json").read_text())["hidden_size"]
    d, _ = _with_extra(tmp_path, {name: torch.ones(H)})
    with pytest.raises(BadInput) as e:
        load_draft(d, TARGET)
    msg = str(e.value)
    assert "\n" not in msg and f"[{name}]" in msg and "AutoWeightsLoader._load_module" in msg


def test_a_bias_or_rotary_cache_is_ignored_as_vllm_ignores_it(tmp_path):
    """An extra fc.bias is not served by vLLM 0.32.0 (AutoWeightsLoader ignores unexpected '.bias'): the offline draft
    leaves it out too, says so in its sources, and gives the same logits as the draft without it."""
    cfg = json.loads((TRAINED / "config.json").read_text())
    H = cfg["hidden_size"]
    d, _ = _with_extra(tmp_path, {"fc.bias": torch.full((H,), 0.5), "layers.0.self_attn.rotary_emb.inv_freq": torch.ones(32)})
    with_extra, plain = load_draft(d, TARGET), load_draft(TRAINED, TARGET)
    assert set(with_extra.sources["ignored"]) == {"fc.bias", "layers.0.self_attn.rotary_emb.inv_freq"}
    assert "'.bias'" in with_extra.sources["ignored"]["fc.bias"] and "ignored" not in plain.sources
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg["vocab_size"], (6,), generator=g)
    hidden = torch.randn(6, H, generator=g)
    a = with_extra.extend(tokens, hidden, torch.arange(6)).logits
    b = plain.extend(tokens, hidden, torch.arange(6)).logits
    assert torch.equal(a, b)


def test_a_whole_vocabulary_draft_refuses_a_vocab_map():
    """EAGLE-1 drafts over the target's whole vocabulary (``Eagle3Draft.WHOLE_VOCAB``): a d2t fix offline is refused
    in one line naming the field, where an EAGLE-3 draft takes it."""
    draft = load_draft(ROOT / "env/models/llama_h64/draft_eagle1", ROOT / "env/models/llama_h64/target")
    with pytest.raises(BadInput, match=r"\[d2t\]: an EAGLE-1 draft drafts over the target's whole vocabulary"):
        draft.with_vocab_map(torch.zeros(draft.arch.vocab, dtype=torch.long), "d2t.npy")
    eagle3 = load_draft(ROOT / "env/models/llama_h64/draft", ROOT / "env/models/llama_h64/target")
    mapped = eagle3.with_vocab_map(torch.zeros(eagle3.arch.draft_vocab, dtype=torch.long), "d2t.npy")
    assert mapped.arch.draft_vocab == eagle3.arch.draft_vocab
