"""The NextN (MTP) head of the Kimi-class target run offline (helpers/draft/nextn.py) as SGLang 0.5.23 runs it with
``--speculative-algorithm NEXTN``: equal to SGLang's own ``DeepseekV3ForCausalLMNextN`` forward (its loader, its
``set_embed_and_head``, its torch_native MLA attention and MoE, in the SGLang venv: tests/support/
sglang_nextn_forward.py) on a target copy with a NextN layer 8 (random head tensors, the decoder the target's last
MoE layer) and the target's real post-norm hidden states; the drafting replay of helpers/draft/simulate.py runs it;
a missing head tensor is one BadInput line naming the file and key."""
from __future__ import annotations

import os
import shutil
import subprocess

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers.draft.nextn import NextNHead, nextn_tensor_names
from helpers.draft.simulate import DraftSettings, SimSequence, simulate_sequences
from helpers.errors import BadInput
from support import ROOT

TARGET = ROOT / "env" / "models" / "kimi" / "target"
SAMPLE = ROOT / "env" / "models" / "kimi" / "data" / "sample"
SGLANG_PY = ROOT / "env" / "reference" / ".venv" / "bin" / "python"


def _with_nextn(out, seed: int = 0, drop: str | None = None):
    """A copy of the Kimi target whose safetensors also hold ``model.layers.8.*``: the decoder the target's layer 7
    (MoE), ``enorm`` / ``hnorm`` / ``shared_head.norm`` ~ 1 + N(0, 0.1), ``eh_proj`` ~ N(0, 0.05), the
    checkpoint's own ``embed_tokens`` / ``shared_head.head`` copies perturbed (SGLang must not read them);
    ``drop``: a name left out."""
    out.mkdir(parents=True, exist_ok=True)
    for f in TARGET.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, out / f.name)
    w = load_file(str(TARGET / "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    H = w["model.embed_tokens.weight"].shape[1]
    for k in [k for k in w if k.startswith("model.layers.7.")]:
        w[k.replace("model.layers.7.", "model.layers.8.")] = w[k].clone()
    for n in ("enorm", "hnorm", "shared_head.norm"):
        w[f"model.layers.8.{n}.weight"] = 1 + 0.1 * torch.randn(H, generator=g)
    w["model.layers.8.eh_proj.weight"] = 0.05 * torch.randn(H, 2 * H, generator=g)
    w["model.layers.8.embed_tokens.weight"] = w["model.embed_tokens.weight"] + 1.0
    w["model.layers.8.shared_head.head.weight"] = w["lm_head.weight"] + 1.0
    if drop:
        del w[drop]
    save_file({k: v.contiguous() for k, v in w.items()}, str(out / "model.safetensors"))
    return out


def _target_hidden(ids: torch.Tensor) -> torch.Tensor:
    """The target's post-final-norm last hidden state per position (transformers' DeepseekV3ForCausalLM, fp32)."""
    from transformers import AutoModelForCausalLM
    m = AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()
    with torch.no_grad():
        return m.model(input_ids=ids[None]).last_hidden_state[0]


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("nextn")
    folder = _with_nextn(tmp / "target")
    d = torch.load(SAMPLE / "rows_0-2000" / "data_0.ckpt", weights_only=True)
    ids = d["input_ids"].reshape(-1)[:65]
    return folder, ids, _target_hidden(ids)


def test_nextn_equals_sglangs_own_deepseekv3forcausallmnextn(case, tmp_path):
    """Draft-extend rows (token t+1, the target's post-norm state at t, positions 0..T-1 and 200 + 3t): logits and the
    carried hidden state equal SGLang's own module's on every row, float32; the second run's positions (200 + 3t)
    change the relative distances, so the rope is compared too."""
    if not SGLANG_PY.exists():
        pytest.skip("env/reference/.venv (sglang 0.5.23) not installed")
    folder, ids, hid = case
    T = ids.shape[0] - 1
    head = NextNHead.load(folder, dtype=torch.float32)
    assert head.sources["embed"].endswith("model.embed_tokens.weight")
    assert head.sources["lm_head"].endswith(":lm_head.weight")
    env = {**os.environ, "SGLANG_USE_CPU_ENGINE": "1", "TORCHDYNAMO_DISABLE": "1", "E3F_LOOPBACK_STORE": "1",
           "PYTHONPATH": str(ROOT / "env" / "reference" / "standin")}
    args, xs = [], {}
    for start, stride in ((0, 1), (200, 3)):     # a uniform shift alone would change nothing: the rope is relative
        xs[start] = {"input_ids": ids[1:T + 1], "hidden": hid[:T], "positions": start + stride * torch.arange(T)}
        torch.save(xs[start], tmp_path / f"in{start}.pt")
        args += [str(tmp_path / f"in{start}.pt"), str(tmp_path / f"out{start}.pt")]
    res = subprocess.run([str(SGLANG_PY), str(ROOT / "tests" / "support" / "sglang_nextn_forward.py"), str(folder),
                          *args], cwd=ROOT / "tests" / "support", capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    outs = {}
    for start, x in xs.items():
        out = outs[start] = torch.load(tmp_path / f"out{start}.pt", weights_only=True)
        assert out["attention"] == ["MLA"] and out["nan_params"] == [], (out["attention"], out["nan_params"])
        ext = head.extend(x["input_ids"], x["hidden"], x["positions"])
        diff = (ext.logits - out["logits"]).abs().max().item()
        hdiff = (ext.hidden - out["hidden"]).abs().max().item()
        assert diff < 1e-4 and hdiff < 1e-4, (start, diff, hdiff)      # measured 9.5e-7 / 3.6e-7 (logits up to 4.8)
        assert (ext.logits.argmax(-1) == out["logits"].argmax(-1)).all()
    # the positions reach the rope: the two runs differ (rows after the first, whose only key is itself)
    assert (outs[0]["hidden"][1:] - outs[200]["hidden"][1:]).abs().max() > 1e-3
