"""The MiMo MTP head offline as vLLM 0.32.0 runs it (helpers.draft.mimo_mtp), on the pair env/models/make_mimo_pair.py
builds from the llama_h64 target and its EAGLE-1 draft: the layer against an independent computation with
transformers' own Qwen2DecoderLayer, the embedding zeroed at position 0, the pre-norm state the head reads, and the
loader's refusals. One pair build per module (about 5-40 s on 2 busy cores: the builder's calibration runs the target
on 16 prompts)."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from helpers.draft.loader import load_draft
from helpers.draft.mimo_mtp import MiMoMTPHead
from helpers.errors import BadInput
from support import ROOT, import_from

H64 = ROOT / "env" / "models" / "llama_h64"


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    build = import_from(ROOT / "env" / "models", "make_mimo_pair").build
    out = tmp_path_factory.mktemp("mimo")
    build(out)
    return out


@pytest.fixture(scope="module")
def target(pair):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(str(pair), dtype=torch.float32).eval()


def _states(model, ids):
    last = {}
    h = model.model.layers[-1].register_forward_hook(lambda m, i, o: last.update(x=o[0] if isinstance(o, tuple) else o))
    with torch.no_grad():
        post = model.model(input_ids=ids[None]).last_hidden_state[0]
    h.remove()
    return last["x"][0], post


def _ids():
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(H64 / "target"))
    text = json.loads((ROOT / "env" / "models" / "prompts.json").read_text())["prompts"][0]
    return torch.tensor(tok(text)["input_ids"])


def _reference_logits(pair, model, tokens, pre, zero_first: bool):
    """The layer computed with transformers' Qwen2DecoderLayer (not the tool's attention / MLP code)."""
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer, Qwen2RotaryEmbedding
    cfg = model.config
    cfg._attn_implementation = "eager"
    w = {k[len("model.mtp_layers.0."):]: v.float() for k, v in load_file(str(pair / "model.safetensors")).items()
         if k.startswith("model.mtp_layers.0.")}
    layer = Qwen2DecoderLayer(cfg, 0).eval()
    layer.load_state_dict({k: v for k, v in w.items() if k.startswith(("self_attn.", "mlp.", "input_layernorm",
                                                                         "post_attention_layernorm"))})
    T = tokens.shape[0]
    e = model.model.embed_tokens(tokens)
    if zero_first:
        e = e.clone()
        e[0] = 0
    eps = cfg.rms_norm_eps
    x = F.linear(torch.cat([F.rms_norm(pre, (pre.shape[-1],), w["hidden_layernorm.weight"], eps),
                            F.rms_norm(e, (e.shape[-1],), w["token_layernorm.weight"], eps)], -1),
                 w["input_proj.weight"])
    pos = torch.arange(T)[None]
    cos_sin = Qwen2RotaryEmbedding(cfg)(x[None], pos)
    mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        y = layer(x[None], attention_mask=mask, position_ids=pos, position_embeddings=cos_sin)[0]
    out = F.rms_norm(y, (y.shape[-1],), w["final_layernorm.weight"], eps)
    return F.linear(out, model.lm_head.weight)


def test_head_matches_transformers_qwen2_layer_with_vllm_position0_rule(pair, target):
    ids = _ids()
    pre, _ = _states(target, ids)
    tokens, h = ids[1:], pre[:-1]                  # row t: token t+1 with the state at t (the drafter's shift)
    head = load_draft(pair, pair)
    assert isinstance(head, MiMoMTPHead)
    got = head.extend(tokens, h).logits
    want = _reference_logits(pair, target, tokens, h, zero_first=True)
    unmasked = _reference_logits(pair, target, tokens, h, zero_first=False)
    assert (got - want).abs().max() < 2e-4 * want.abs().max()
    # position 0's zero embedding changes row 0 (and, through attention, later rows): the rule is not a no-op here
    assert (got[0] - unmasked[0]).abs().max() > 1e-2 * unmasked[0].abs().max()


def test_hidden_layernorm_of_pre_norm_state_is_the_target_post_norm_state(pair, target):
    """The builder's mapping: vLLM feeds MiMo's head out(n-1) (pre-norm) and hidden_layernorm carries the target's
    final-norm weight, so the head sees exactly the post-norm state the EAGLE-1 draft was trained on."""
    ids = _ids()
    pre, post = _states(target, ids)
    w = load_file(str(pair / "model.safetensors"))["model.mtp_layers.0.hidden_layernorm.weight"].float()
    normed = F.rms_norm(pre, (pre.shape[-1],), w, target.config.rms_norm_eps)
    assert (normed - post).norm() / post.norm() < 1e-5
    assert (pre - post).norm() / post.norm() > 0.3          # the two candidates are far apart on this target


def test_head_drafts_better_than_chance_and_rule_matters(pair, target):
    """Teacher-forced top-1 of the head on the target's greedy tokens: the converted head predicts (>> 1/4096), and
    with the pre-norm state (vLLM's rule) at least as well as with the post-norm one."""
    ids = _ids()
    with torch.no_grad():
        seq = target.generate(ids[None], max_new_tokens=24, do_sample=False)[0]
    pre, post = _states(target, seq)
    head = load_draft(pair, pair)
    nxt = seq[2:]                                   # row t predicts token t+2
    acc = {}
    for name, h in (("pre", pre), ("post", post)):
        logits = head.extend(seq[1:], h[:-1]).logits[:-1]
        acc[name] = float((logits.argmax(-1) == nxt).float().mean())
    assert acc["pre"] > 0.2
    assert acc["pre"] >= acc["post"] - 0.05


def test_loader_refusals_name_the_field(pair, tmp_path):
    bad = tmp_path / "two"
    shutil.copytree(pair, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = 2
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(BadInput, match="num_nextn_predict_layers"):
        MiMoMTPHead.load(bad)
    miss = tmp_path / "miss"
    shutil.copytree(pair, miss)
    w = load_file(str(miss / "model.safetensors"))
    del w["model.mtp_layers.0.input_proj.weight"]
    save_file(w, str(miss / "model.safetensors"))
    with pytest.raises(BadInput, match=r"model\.mtp_layers\.0\.input_proj\.weight"):
        MiMoMTPHead.load(miss)
