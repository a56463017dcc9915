"""Generated vLLM-specific faults from public reports (issue 38, part 4): seeded draws of a fault class and a
strength on the head_dim-64 Llama pair (``env/models/llama_h64``) served by vLLM 0.32.0 from a speculators-format
draft, each knowing its TRUE stage. The draft vLLM serves is the trained draft converted to the speculators format
the way the project converts it (:func:`helpers.formats.speculators.convert_eagle3_to_speculators`), with the ids
written vLLM's way (top-level ``eagle_aux_hidden_state_layer_ids`` [2, 4, 5] = in(i): out(1), out(3), out(4), the
trained plan), then the fault:

* ``clean`` (none): the conversion as above.
* ``norm_before_fc_dropped`` (draft): the draft was trained WITH ``norm_before_fc`` (an RMSNorm over the
  concatenated aux states before ``fc``, ``model.input_norm``); the conversion forwards neither the flag nor, when
  ``keep_weight`` is false, the weight. vLLM then builds no ``input_norm`` and drops an ``input_norm.weight`` it is
  given without a word (``vllm/model_executor/models/llama_eagle3.py::Eagle3LlamaForCausalLM.load_weights``:
  ``orig_to_new_substr["input_norm."] = None`` when ``norm_before_fc`` is false). The trained draft: the reference
  draft's ``fc`` refitted by least squares over the training aux states so that ``fc'(input_norm(x))`` reproduces
  ``fc(x)``, with ``input_norm.weight = level * exp(spread * N(0, 1))`` per channel (``level`` log-uniform 0.1 .. 10
  x the median RMS of the aux states, ``spread`` uniform 0 .. 0.5): without the norm ``fc'`` sees ``x`` where it was
  fitted on ``w * x / rms(x)``, a per-token scale and a per-channel distortion of the drawn strength.
* ``rope_scaling_dropped`` (draft): the draft was trained with linear rope scaling of factor
  ``rope_theta ** (2k / head_dim)`` (``k`` 1 .. 4 drawn: factors 1.33, 1.78, 2.37, 3.16 for theta 1e4 and head_dim
  64); the conversion forwards ``rope_theta`` and not the scaling (``_llama_layer_config``), and vLLM's draft builds
  its rotary embedding from its own config (``llama_eagle3.py::LlamaDecoderLayer`` -> ``get_rope``). The trained
  draft: the reference's q / k rows of rotary pair ``j + k`` moved to pair ``j`` (neox pairs (i, i + 32) per head),
  so that with the scaling pair ``j``'s frequency ``theta^(-2j/64) / factor = theta^(-2(j+k)/64)`` is exactly the
  frequency those rows were trained at (the ``k`` highest-frequency pairs go to the ``k`` lowest slots, the one part
  that is not exact); without the scaling every moved pair runs ``k`` pairs faster than trained.
* ``own_embedding`` (draft): the converted draft's ``embed_tokens.weight`` (the converter copies the verifier's when
  the draft has none) is the target's plus Gaussian noise of ``strength`` (log-uniform 0.03 .. 3) x its std: vLLM
  keeps a draft's own embedding unless it equals the target's (``v1/spec_decode/llm_base_proposer.py::
  _maybe_share_embeddings``); SGLang would use the target's.
* ``ids_lost`` (wiring): the draft was trained on the aux states of another plan (SpecForge ``out(i)``, drawn as the
  faultgen layer offsets are: all ids shifted or one id moved, 0 .. 6, not the default's); the conversion writes no
  ids (``keep_layer_ids=False``, as the converter read forwards none) and vLLM captures its default
  ``(2, n // 2, n - 3)`` = in(2), in(4), in(5) = out(1), out(3), out(4) (``vllm/model_executor/models/llama.py::
  LlamaForCausalLM.get_eagle3_default_aux_hidden_state_layers``). The training data are the reference samples' tokens
  with the drawn plan's states from HF transformers on the target (the weights stay the reference's: the wiring
  evidence is the served tensors against the training data and the every-layer reference).

A strength is random within the class: a mild draw may cost nothing measurable; the loss is measured
(``bench/bench_vllm_faults.py``), never assumed."""
from __future__ import annotations

import json
import math
import random
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
from safetensors.torch import load_file, save_file

from . import ROOT

H64 = ROOT / "env" / "models" / "llama_h64"
DRAFT, TARGET, TRAINING = H64 / "draft", H64 / "target", H64 / "data" / "sample"
VALIDATION = H64 / "data" / "validation"
#: the plan the reference draft was trained on (SpecForge out(i)) and the ids vLLM 0.32.0 serves it from (in(i))
TRAINED_OUT = (1, 3, 4)
VLLM_IDS = (2, 4, 5)
STAGE = {"clean": "none", "norm_before_fc_dropped": "draft", "rope_scaling_dropped": "draft",
         "own_embedding": "draft", "ids_lost": "wiring"}
CLASSES = tuple(STAGE)


@dataclass(frozen=True)
class Built:
    """The folders of one draw: ``trained`` (the draft as trained, SpecForge / SGLang layout, its training log
    inside), ``served`` (the speculators-format folder vLLM loads), ``training`` (the training data)."""

    trained: Path
    served: Path
    training: Path

    @property
    def training_log(self) -> Path:
        return self.trained / "training_log.json"


@dataclass(frozen=True)
class VLLMFault:
    """One drawn fault: ``seed``, ``cls`` (:data:`CLASSES`) and its parameters (JSON-able)."""

    seed: int
    cls: str
    params: dict = field(default_factory=dict)

    @property
    def stage(self) -> str:
        """The true stage: ``none`` / ``draft`` / ``wiring``."""
        return STAGE[self.cls]

    @property
    def label(self) -> str:
        p = self.params
        if self.cls == "norm_before_fc_dropped":
            return (f"norm_before_fc dropped (input_norm level x{p['level']:.2f} of the aux RMS, spread "
                    f"{p['spread']:.2f}, weight {'kept' if p['keep_weight'] else 'dropped'})")
        if self.cls == "rope_scaling_dropped":
            return f"rope_scaling linear x{p['factor']:.2f} dropped (k {p['k']})"
        if self.cls == "own_embedding":
            return f"own embed_tokens, noise {p['strength']:.2f} x std"
        if self.cls == "ids_lost":
            return f"ids lost, trained on out{tuple(p['trained_out'])}"
        return "clean"

    def to_json(self) -> dict:
        return {"seed": self.seed, "class": self.cls, "stage": self.stage, "label": self.label, "params": self.params}

    # ------------------------------------------------------------------------------------------------ building
    def build(self, out: Path) -> Built:
        """Write the draw's folders under ``out`` (``trained/``, ``served/``, and ``training/`` for ``ids_lost``)."""
        return build_all([self], out)


def build_all(faults: list[VLLMFault], out: Path) -> Built:
    """One draft with every fault of ``faults`` (at most one per class) under ``out``: the trained draft (the
    ``norm_before_fc`` / rope-scaling training applied), its training data (``ids_lost``: the drawn plan), the
    conversion (no ids with ``ids_lost``, else vLLM's [2, 4, 5]), then the served checkpoint's edits (a kept
    ``input_norm.weight``, an own ``embed_tokens``). Raises ValueError for two faults of one class."""
    from helpers.formats.speculators import convert_eagle3_to_speculators

    by = {f.cls: f for f in faults}
    if len(by) != len(faults):
        raise ValueError(f"one fault per class, got {[f.cls for f in faults]}")
    out = Path(out)
    trained = out / "trained"
    _copy(DRAFT, trained)
    training = TRAINING
    if "norm_before_fc_dropped" in by:
        f = by["norm_before_fc_dropped"]
        _with_input_norm(trained, f.params, f.seed)
    if "rope_scaling_dropped" in by:
        _with_rope_scaling(trained, by["rope_scaling_dropped"].params["k"])
    if "ids_lost" in by:
        ids = list(by["ids_lost"].params["trained_out"])
        cfg = json.loads((trained / "config.json").read_text())
        cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = ids
        (trained / "config.json").write_text(json.dumps(cfg, indent=2))
        training = training_on(ids, out / "training")
    served = convert_eagle3_to_speculators(trained, out / "served", TARGET, keep_layer_ids="ids_lost" not in by)
    if "ids_lost" not in by:
        cfg = json.loads((served / "config.json").read_text())
        cfg["eagle_aux_hidden_state_layer_ids"] = list(VLLM_IDS)          # written vLLM's way (in(i))
        (served / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    w = load_file(str(served / "model.safetensors"))
    if "norm_before_fc_dropped" in by and by["norm_before_fc_dropped"].params["keep_weight"]:
        w["input_norm.weight"] = load_file(str(trained / "model.safetensors"))["input_norm.weight"]
    if "own_embedding" in by:
        f = by["own_embedding"]
        emb = w["embed_tokens.weight"]
        g = torch.Generator().manual_seed(f.seed)
        w["embed_tokens.weight"] = (emb.float() + f.params["strength"] * emb.float().std()
                                    * torch.randn(emb.shape, generator=g)).to(emb.dtype)
    save_file(w, str(served / "model.safetensors"))
    return Built(trained, served, training)


def _copy(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file():
            shutil.copy(f, dst / f.name)


def aux_states(max_rows: int = 64) -> torch.Tensor:
    """``[N, 3 * 128]`` float32: the aux hidden states of the training samples (every row), the states the draft's
    ``fc`` was trained on."""
    from helpers.formats.training_data import TrainingData

    td = TrainingData(TRAINING, hidden_size=128, max_samples=max_rows)
    rows = [s.load().float().reshape(-1, 384) for s in td]
    return torch.cat(rows)


def _with_input_norm(folder: Path, p: dict, seed: int) -> None:
    """The draft of ``folder`` as if trained with ``norm_before_fc``: ``input_norm.weight`` drawn (module docstring),
    ``fc.weight`` refitted by least squares so that ``fc'(rms_norm(x) * w)`` matches ``fc(x)`` over the training aux
    states (float32, stored as the checkpoint's dtype)."""
    w = load_file(str(folder / "model.safetensors"))
    fc = w["fc.weight"].float()
    x = aux_states()
    rms = x.pow(2).mean(-1, keepdim=True).add(1e-5).sqrt()
    g = torch.Generator().manual_seed(seed)
    norm_w = p["level"] * float(rms.median()) * torch.exp(p["spread"] * torch.randn(x.shape[1], generator=g))
    z = x / rms * norm_w
    y = x @ fc.T
    fit = torch.linalg.lstsq(z.double(), y.double()).solution.T.float()       # [128, 384]
    w["fc.weight"] = fit.to(w["fc.weight"].dtype)
    w["input_norm.weight"] = norm_w.to(w["fc.weight"].dtype)
    save_file(w, str(folder / "model.safetensors"))
    cfg = json.loads((folder / "config.json").read_text())
    cfg["eagle_config"]["norm_before_fc"] = True
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))


def rope_factor(k: int, theta: float = 10000.0, head_dim: int = 64) -> float:
    """The linear rope factor that moves rotary pair ``j``'s frequency to pair ``j + k``'s: ``theta ** (2k / d)``."""
    return theta ** (2 * k / head_dim)


def _with_rope_scaling(folder: Path, k: int) -> None:
    """The draft of ``folder`` as if trained with linear rope scaling ``rope_factor(k)``: each head's q / k rows of
    rotary pair ``(j + k) % 32`` (rows ``i`` and ``i + 32``, neox style) moved to pair ``j``; the config's
    ``rope_scaling`` / ``rope_parameters`` say the scaling."""
    cfg = json.loads((folder / "config.json").read_text())
    hd, half = cfg["head_dim"], cfg["head_dim"] // 2
    w = load_file(str(folder / "model.safetensors"))
    src = torch.tensor([(j + k) % half for j in range(half)])
    perm = torch.cat([src, src + half])
    for name, heads in (("midlayer.self_attn.q_proj.weight", cfg["num_attention_heads"]),
                        ("midlayer.self_attn.k_proj.weight", cfg["num_key_value_heads"])):
        t = w[name]
        w[name] = torch.cat([t[h * hd:(h + 1) * hd][perm] for h in range(heads)]).contiguous()
    save_file(w, str(folder / "model.safetensors"))
    f = rope_factor(k, cfg["rope_theta"], hd)
    cfg["rope_scaling"] = {"rope_type": "linear", "factor": f}
    cfg["rope_parameters"] = {"rope_theta": cfg["rope_theta"], "rope_type": "linear", "factor": f}
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))


def training_on(layers: list[int], out: Path) -> Path:
    """The reference samples' tokens with aux states of other layers (SpecForge out(i) = HF hidden_states[i + 1])
    from HF transformers on the target (float32, stored bf16), as if the draft had been trained on them; the vocab map
    copied, ``capture.json``'s layer ids rewritten."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(TARGET, torch_dtype=torch.float32).eval()
    rows = out / "rows_0-2000"
    rows.mkdir(parents=True)
    for f in sorted((TRAINING / "rows_0-2000").glob("data_*.ckpt")):
        rec = torch.load(f, weights_only=True)
        with torch.no_grad():
            hs = hf(rec["input_ids"][None], output_hidden_states=True).hidden_states
        rec["aux_hidden_state"] = torch.cat([hs[i + 1] for i in layers], -1).to(torch.bfloat16)
        rec["hidden_state"] = hs[-1].to(torch.bfloat16)
        torch.save(rec, rows / f.name)
    shutil.copytree(TRAINING / "vocab_mapping", out / "vocab_mapping")
    cap = json.loads((TRAINING / "capture.json").read_text())
    cap["layer_ids"] = {"specforge_out_i": layers}
    (out / "capture.json").write_text(json.dumps(cap))
    return out


def _loguniform(r: random.Random, lo: float, hi: float) -> float:
    return math.exp(r.uniform(math.log(lo), math.log(hi)))


def draw(seed: int, cls: Optional[str] = None) -> VLLMFault:
    """One fault drawn from ``seed``: the class (``cls``, or uniform over :data:`CLASSES`) and its strength.
    Raises ValueError for an unknown class."""
    r = random.Random(seed)
    cls = cls or r.choice(CLASSES)
    if cls not in STAGE:
        raise ValueError(f"unknown vLLM fault class {cls!r} (expected one of {', '.join(CLASSES)})")
    p: dict = {}
    if cls == "norm_before_fc_dropped":
        p = {"level": round(_loguniform(r, 0.1, 10.0), 3), "spread": round(r.uniform(0.0, 0.5), 3),
             "keep_weight": r.random() < 0.5}
    elif cls == "rope_scaling_dropped":
        p["k"] = r.randint(1, 4)
        p["factor"] = round(rope_factor(p["k"]), 4)
    elif cls == "own_embedding":
        p["strength"] = round(_loguniform(r, 0.03, 3.0), 3)
    elif cls == "ids_lost":
        while True:
            base = list(TRAINED_OUT)
            if r.random() < 0.5:
                s = r.choice((-1, 1, 2))
                ids = [i + s for i in base]
            else:
                ids = list(base)
                ids[r.randrange(3)] += r.choice((-2, -1, 1, 2))
            ids = sorted(ids)
            if len(set(ids)) == 3 and all(0 <= i <= 6 for i in ids) and tuple(ids) != TRAINED_OUT:
                break
        p["trained_out"] = ids
    return VLLMFault(seed, cls, p)


def draws(n: int, seed: int = 0) -> list[VLLMFault]:
    """``n`` faults from ``seed``: the classes in turn (each once ``n >= len(CLASSES)``), each with its own seed and
    random strength."""
    r = random.Random(seed)
    order = list(CLASSES)
    r.shuffle(order)
    return [draw(r.randrange(2 ** 31), order[i % len(order)]) for i in range(n)]
