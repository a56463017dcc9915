"""A generator of faults the acceptance budget was not shaped on: seeded draws of a fault class and a strength, each
knowing its TRUE stage, and the ways to apply one (a draft copy, server flags, the served plan, the settings).

Classes (true stage in brackets):

* ``clean`` (none): no fault.
* ``tensor`` (draft): one tensor of the draft checkpoint (fc, q/k/v/o, gate/up/down, the norms, lm_head) damaged:
  Gaussian noise of a fraction (log-uniform 0.03 .. 3) of the tensor's RMS (its std for the zero-mean matrices), or a
  random 5-60 % of its rows (elements of a norm) scaled by 0.2-0.5 or 2-4, or zeroed.
* ``d2t`` (draft): 5-60 % of the d2t slots permuted among themselves (each chosen draft id mapped to another chosen
  slot's target token; t2d untouched): the vocab map of another training run, in part.
* ``layer_offset`` (wiring): the draft config's ``eagle_aux_hidden_state_layer_ids`` shifted (all by one shift, or one
  id): SGLang 0.5.23 serves the plan its rules give for the new ids (``helpers.diagnosis.conventions.served_plan``)
  while the weights were trained on ``out(1), out(3), out(4)``.
* ``chunk_order`` (wiring): the served chunks permuted (``--faults`` ``chunk_order``, a forward hook on the target).
* ``settings`` (settings): ``--speculative-num-steps`` 1 or 2 (chain), or a topk 2-4 tree with steps 1-3 and a
  random valid draft-token count.
* ``hook`` (engine): ``helpers.hooks:perturb_factory`` on one or both draft-only modules of SGLang's
  ``LlamaForCausalLMEagle3`` (``model.fc``, ``model.layers.0.hidden_norm``; the target has neither) with random
  noise (0.05 .. 1.5 x the output's RMS) and / or scale.

A strength is random within the class: a draw may cost nothing measurable (a mild one) or everything (a severe one);
its loss is measured, never assumed (:mod:`tests.unit.draft.test_fault_matrix`, ``bench/bench_faults.py``).
"""
from __future__ import annotations

import json
import math
import random
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import torch
from safetensors.torch import load_file, save_file

from . import ROOT

DRAFT = ROOT / "env" / "models" / "draft"
TARGET = ROOT / "env" / "models" / "target"
#: the ids the reference draft was trained on (SpecForge out(i)) and the tensors they name
TRAINED_IDS = (1, 3, 4)
TRAINED_PLAN = ("out(1)", "out(3)", "out(4)")
#: fault class -> its true stage
STAGE = {"clean": "none", "tensor": "draft", "d2t": "draft", "layer_offset": "wiring", "chunk_order": "wiring",
         "settings": "settings", "hook": "engine"}
CLASSES = tuple(STAGE)
#: the draft checkpoint's float tensors (every one SGLang loads)
TENSORS = ("fc.weight", "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight",
           "midlayer.self_attn.v_proj.weight", "midlayer.self_attn.o_proj.weight", "midlayer.mlp.gate_proj.weight",
           "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight", "midlayer.hidden_norm.weight",
           "midlayer.input_layernorm.weight", "midlayer.post_attention_layernorm.weight", "norm.weight",
           "lm_head.weight")
#: draft modules of SGLang's LlamaForCausalLMEagle3 that the target model does not have (a hook there touches the
#: draft only; sglang/srt/models/llama_eagle3.py::LlamaModel.__init__ / LlamaDecoderLayer.__init__)
DRAFT_ONLY_MODULES = ("model.fc", "model.layers.0.hidden_norm")
#: the served settings of a clean server
CLEAN_SETTINGS = (3, 1, 4)


@dataclass(frozen=True)
class GenFault:
    """One drawn fault: ``cls`` (:data:`CLASSES`), ``seed`` and the class's parameters (JSON-able)."""

    seed: int
    cls: str
    params: dict = field(default_factory=dict)

    @property
    def stage(self) -> str:
        """The true stage: ``none`` / ``draft`` / ``wiring`` / ``settings`` / ``engine``."""
        return STAGE[self.cls]

    @property
    def label(self) -> str:
        p = self.params
        if self.cls == "tensor":
            short = p["tensor"].replace("midlayer.", "").replace(".weight", "")
            how = (f"noise {p['strength']:.2f}" if p["mode"] == "noise" else
                   f"{p['mode']} {p['fraction']:.0%}" + (f" x{p['factor']:.2f}" if p["mode"] == "scale_rows" else ""))
            return f"tensor {short} {how}"
        if self.cls == "d2t":
            return f"d2t {p['fraction']:.0%} of slots permuted"
        if self.cls == "layer_offset":
            return f"config ids {p['ids']}"
        if self.cls == "chunk_order":
            return f"chunk order {p['order']}"
        if self.cls == "settings":
            return "steps {} topk {} draft tokens {}".format(*p["settings"])
        if self.cls == "hook":
            return "hook " + ", ".join(f"{m.split('.')[-1]} noise {c['noise']:.2f} scale {c['scale']:.2f}"
                                       for m, c in zip(p["modules"], p["configs"]))
        return "clean"

    def to_json(self) -> dict:
        return {"seed": self.seed, "class": self.cls, "stage": self.stage, "label": self.label,
                "params": self.params}

    # --------------------------------------------------------------------------------------- how it is applied
    @property
    def settings(self) -> tuple[int, int, int]:
        """The served ``(steps, topk, draft_tokens)``."""
        return tuple(self.params["settings"]) if self.cls == "settings" else CLEAN_SETTINGS

    def served_plan(self, target: Path = TARGET) -> list[str]:
        """The tensors the server feeds the draft, in order (SGLang 0.5.23's rules for a draft config's ids, the
        chunk permutation of a ``chunk_order`` hook; the trained plan otherwise)."""
        if self.cls == "chunk_order":
            return [TRAINED_PLAN[i] for i in self.params["order"]]
        if self.cls == "layer_offset":
            # lazy: the diagnosis package is only needed by this class's offline plan
            from helpers.diagnosis.conventions import served_plan
            from helpers.formats.configs import read_draft_config, read_target_config

            raw = json.loads((DRAFT / "config.json").read_text())
            raw["eagle_config"] = {**raw["eagle_config"], "eagle_aux_hidden_state_layer_ids": list(self.params["ids"])}
            with tempfile.TemporaryDirectory(prefix="e3f-faultgen-") as tmp:
                (Path(tmp) / "config.json").write_text(json.dumps(raw))
                draft = read_draft_config(Path(tmp) / "config.json")
            return list(served_plan(draft, read_target_config(target), version="0.5.23").tensors)
        return list(TRAINED_PLAN)

    def draft_copy(self, out: Path, src: Path = DRAFT) -> Path:
        """The draft folder the server loads: ``src`` itself, or a copy under ``out`` with the damaged tensor, the
        permuted d2t or the shifted config ids."""
        if self.cls not in ("tensor", "d2t", "layer_offset"):
            return src
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        for f in src.iterdir():
            shutil.copy(f, out / f.name)
        if self.cls == "layer_offset":
            raw = json.loads((src / "config.json").read_text())
            raw["eagle_config"] = {**raw["eagle_config"], "eagle_aux_hidden_state_layer_ids": list(self.params["ids"])}
            (out / "config.json").write_text(json.dumps(raw, indent=2))
            return out
        w = load_file(str(src / "model.safetensors"))
        g = torch.Generator().manual_seed(self.seed)
        if self.cls == "tensor":
            w[self.params["tensor"]] = damage(w[self.params["tensor"]], self.params, g)
        else:
            w["d2t"] = permute_d2t(w["d2t"], self.params["fraction"], g)
        save_file(w, str(out / "model.safetensors"))
        return out

    def server_args(self) -> list[str]:
        """``python -m helpers server start`` flags: the settings, a ``--faults`` hook, ``--forward-hooks``."""
        s = self.settings
        args = ["--steps", str(s[0]), "--topk", str(s[1]), "--draft-tokens", str(s[2])]
        if self.cls == "chunk_order":
            args += ["--faults", json.dumps([{"kind": "chunk_order", "order": list(self.params["order"])}])]
        if self.cls == "hook":
            args += ["--forward-hooks", json.dumps(self.hook_specs())]
        return args

    def hook_specs(self) -> list[dict]:
        """SGLang ``--forward-hooks`` specs of a ``hook`` fault (one per module)."""
        return [{"name": f"gen-perturb-{i}", "target_modules": [m], "hook_factory": "helpers.hooks:perturb_factory",
                 "config": c} for i, (m, c) in enumerate(zip(self.params["modules"], self.params["configs"]))]


def damage(t: torch.Tensor, p: dict, g: torch.Generator) -> torch.Tensor:
    """``t`` damaged as ``p`` says (same dtype and shape): ``noise`` (``strength`` x the tensor's RMS of Gaussian
    noise), ``scale_rows`` (``fraction`` of the rows times ``factor``), ``zero_rows`` (``fraction`` of the rows
    zeroed); rows are dim 0 (elements of a 1-D norm weight)."""
    x = t.float().clone()
    if p["mode"] == "noise":
        rms = x.pow(2).mean().sqrt()
        x = x + p["strength"] * rms * torch.randn(x.shape, generator=g)
    else:
        n = x.shape[0]
        k = max(1, int(round(p["fraction"] * n)))
        rows = torch.randperm(n, generator=g)[:k]
        x[rows] = 0.0 if p["mode"] == "zero_rows" else x[rows] * p["factor"]
    return x.to(t.dtype)


def permute_d2t(d2t: torch.Tensor, fraction: float, g: torch.Generator) -> torch.Tensor:
    """``d2t`` (offsets: target id = draft id + d2t[draft id]) with ``fraction`` of its slots given another chosen
    slot's target id (a cyclic shift of the chosen slots in random order, so every chosen slot changes)."""
    n = d2t.shape[0]
    k = max(2, int(round(fraction * n)))
    hot = d2t + torch.arange(n, dtype=d2t.dtype)
    slots = torch.randperm(n, generator=g)[:k]
    new = hot.clone()
    new[slots] = hot[slots.roll(1)]
    return (new - torch.arange(n, dtype=d2t.dtype)).to(d2t.dtype)


def _loguniform(r: random.Random, lo: float, hi: float) -> float:
    return math.exp(r.uniform(math.log(lo), math.log(hi)))


def draw(seed: int, cls: Optional[str] = None, classes: Sequence[str] = CLASSES) -> GenFault:
    """One fault drawn from ``seed``: the class (``cls``, or uniform over ``classes``) and its parameters."""
    r = random.Random(seed)
    cls = cls or r.choice(list(classes))
    if cls not in STAGE:
        raise ValueError(f"unknown fault class {cls!r} (expected one of {', '.join(CLASSES)})")
    p: dict = {}
    if cls == "tensor":
        p["tensor"] = r.choice(TENSORS)
        p["mode"] = r.choice(("noise", "noise", "scale_rows", "zero_rows"))
        if p["mode"] == "noise":
            p["strength"] = round(_loguniform(r, 0.03, 3.0), 3)
        else:
            p["fraction"] = round(r.uniform(0.05, 0.6), 3)
            if p["mode"] == "scale_rows":
                p["factor"] = round(r.choice((r.uniform(0.2, 0.5), r.uniform(2.0, 4.0))), 3)
    elif cls == "d2t":
        p["fraction"] = round(r.uniform(0.05, 0.6), 3)
    elif cls == "layer_offset":
        while True:
            if r.random() < 0.5:
                s = r.choice((-2, -1, 1, 2))
                ids = [i + s for i in TRAINED_IDS]
            else:
                ids = list(TRAINED_IDS)
                c = r.randrange(3)
                ids[c] += r.choice((-2, -1, 1, 2))
            ids = sorted(ids)
            # SGLang 0.5.23 on this 8-layer Llama: ids -1 .. 6 (capture index 0 .. 7; -1 is the embedding), distinct
            if all(-1 <= i <= 6 for i in ids) and len(set(ids)) == 3 and tuple(ids) != TRAINED_IDS:
                break
        p["ids"] = ids
    elif cls == "chunk_order":
        order = [0, 1, 2]
        while order == [0, 1, 2]:
            r.shuffle(order)
        p["order"] = order
    elif cls == "settings":
        if r.random() < 0.5:
            s = r.choice((1, 2))
            p["settings"] = [s, 1, s + 1]
        else:
            s, k = r.choice((1, 2, 3)), r.choice((2, 3, 4))
            most = min(k + (s - 1) * k * k + 1, 8)
            p["settings"] = [s, k, r.randint(2, most)]
    elif cls == "hook":
        mods = r.choice((DRAFT_ONLY_MODULES[:1], DRAFT_ONLY_MODULES[1:], DRAFT_ONLY_MODULES))
        p["modules"] = list(mods)
        p["configs"] = [{"noise": round(_loguniform(r, 0.05, 1.5), 3),
                         "scale": round(r.choice((1.0, 1.0, r.uniform(0.5, 2.0))), 3),
                         "seed": r.randrange(1000)} for _ in mods]
    return GenFault(seed, cls, p)


def draws(n: int, seed: int = 0, classes: Sequence[str] = CLASSES) -> list[GenFault]:
    """``n`` faults from ``seed``: the classes in turn (every class appears once ``n >= len(classes)``), each with
    its own seed and random strength."""
    r = random.Random(seed)
    order = list(classes)
    r.shuffle(order)
    return [draw(r.randrange(2 ** 31), order[i % len(order)]) for i in range(n)]
