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
  random draft-token count SGLang 0.5.23 serves (steps + 1 .. 8).
* ``hook`` (engine): ``helpers.hooks:perturb_factory`` on one or both draft-only modules of SGLang's
  ``LlamaForCausalLMEagle3`` (``model.fc``, ``model.layers.0.hidden_norm``; the target has neither) with random
  noise (0.05 .. 1.5 x the output's RMS) and / or scale.

Systems (:data:`SYSTEMS`, ``--system`` of ``bench/bench_faults.py``): the faults are drawn for one served system, a
target, its draft, its training data and the engine that serves them; what a class may touch follows from it (the
draft checkpoint's own tensors, the engine's id rules, the options the engine takes):

* ``llama`` (default): the Llama reference target and draft on SGLang 0.5.23 (every class);
* ``kimi`` / ``kimi-mla``: the Kimi-class target (``DeepseekV3ForCausalLM``: MLA + MoE) with its Llama-style or MLA
  draft (``Eagle3DeepseekV2ForCausalLM``) on SGLang 0.5.23, config ids under ``deepseek_v2.py``'s rule (+1 only when
  the first id is 1; a triple whose capture would raise at the first forward is not drawn);
* ``vllm``: the head_dim-64 Llama pair on vLLM 0.32.0 (ids verbatim as in(i), so the clean server's config says
  [2, 4, 5]; no ``--faults`` / ``--forward-hooks`` there, no topk trees: classes ``clean``, ``tensor``, ``d2t``,
  ``layer_offset``, ``settings`` as ``num_speculative_tokens``).

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
class System:
    """One served system faults are drawn for: ``engine`` (``sglang`` / ``vllm``), ``target`` and ``draft`` folders,
    ``training`` (SpecForge-format samples of the draft's training kind), ``clean_ids`` (the config ids a clean server
    is given, in the engine's convention; None: the draft's own), ``classes`` (the fault classes that apply) and
    ``version`` (the engine release whose id rules decide a config's served plan)."""

    name: str
    engine: str
    target: Path
    draft: Path
    training: Path
    clean_ids: Optional[tuple] = None
    classes: tuple = CLASSES
    version: str = "0.5.23"
    #: draft modules the target does not have, by their name in the engine's draft class (a ``hook`` fault's targets)
    draft_only_modules: tuple = DRAFT_ONLY_MODULES

    @property
    def tensors(self) -> tuple:
        """The draft checkpoint's float tensors (every one the engine loads; d2t / t2d are the vocab map)."""
        from safetensors import safe_open

        with safe_open(str(self.draft / "model.safetensors"), "pt") as f:
            return tuple(k for k in f.keys() if k not in ("d2t", "t2d") and f.get_slice(k).get_dtype()
                         in ("F32", "BF16", "F16"))

    def _rules(self):
        if self.engine == "vllm":
            from helpers.engines.vllm_rules import VLLMRules

            return VLLMRules(self.version)
        from helpers.diagnosis.plan_rules import PlanRules

        return PlanRules(self.version)

    def plan_for(self, ids: Sequence[int]):
        """The engine's served :class:`~helpers.diagnosis.conventions.CapturePlan` of the draft config with ``ids``."""
        from helpers.formats.configs import read_draft_config, read_target_config

        raw = json.loads((self.draft / "config.json").read_text())
        raw["eagle_config"] = {**raw["eagle_config"], "eagle_aux_hidden_state_layer_ids": list(ids)}
        with tempfile.TemporaryDirectory(prefix="e3f-faultgen-") as tmp:
            (Path(tmp) / "config.json").write_text(json.dumps(raw))
            draft = read_draft_config(Path(tmp) / "config.json")
        return self._rules().served_plan(draft, read_target_config(self.target))

    def wiring_ok(self, ids: Sequence[int]) -> bool:
        """``ids`` make a wiring fault here: three distinct ids the engine serves (no start-up or first-forward
        error, three chunks) as another plan than the trained one."""
        if len(set(ids)) != 3:
            return False
        if self.name == "llama":     # the draws recorded in bench/RESULTS.md: capture indices 0 .. 7 on 8 layers
            return all(-1 <= i <= 6 for i in ids) and tuple(ids) != TRAINED_IDS
        plan = self.plan_for(ids)
        return plan.fatal is None and len(plan.tensors) == 3 and tuple(plan.tensors) != TRAINED_PLAN


_MODELS = ROOT / "env" / "models"
#: the systems faults are drawn for (bench/bench_faults.py --system)
SYSTEMS = {
    "llama": System("llama", "sglang", TARGET, DRAFT, _MODELS / "data" / "sample"),
    "kimi": System("kimi", "sglang", _MODELS / "kimi" / "target", _MODELS / "kimi" / "draft",
                   _MODELS / "kimi" / "data" / "sample"),
    # Eagle3DeepseekV2ForCausalLM's one decoder layer is model.midlayer (sglang/srt/models/kimi_k25_eagle3.py::
    # Eagle3MLAModel.__init__), not LlamaForCausalLMEagle3's model.layers.0
    "kimi-mla": System("kimi-mla", "sglang", _MODELS / "kimi" / "target", _MODELS / "kimi" / "draft_mla",
                       _MODELS / "kimi" / "data" / "sample",
                       draft_only_modules=("model.fc", "model.midlayer.hidden_norm")),
    "vllm": System("vllm", "vllm", _MODELS / "llama_h64" / "target", _MODELS / "llama_h64" / "draft",
                   _MODELS / "llama_h64" / "data" / "sample", clean_ids=(2, 4, 5),
                   classes=("clean", "tensor", "d2t", "layer_offset", "settings"), version="0.32.0"),
}
LLAMA = SYSTEMS["llama"]


@dataclass(frozen=True)
class GenFault:
    """One drawn fault: ``cls`` (:data:`CLASSES`), ``seed`` and the class's parameters (JSON-able)."""

    seed: int
    cls: str
    params: dict = field(default_factory=dict)
    system: System = field(default=None, compare=False)   # None: the Llama reference (LLAMA)

    @property
    def sys(self) -> System:
        return self.system or LLAMA

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
                "params": self.params, "system": self.sys.name}

    # --------------------------------------------------------------------------------------- how it is applied
    @property
    def settings(self) -> tuple[int, int, int]:
        """The served ``(steps, topk, draft_tokens)``."""
        return tuple(self.params["settings"]) if self.cls == "settings" else CLEAN_SETTINGS

    def served_plan(self) -> list[str]:
        """The tensors the server feeds the draft, in order (the system's engine rules for a draft config's ids, the
        chunk permutation of a ``chunk_order`` hook; the trained plan otherwise)."""
        if self.cls == "chunk_order":
            return [TRAINED_PLAN[i] for i in self.params["order"]]
        if self.cls == "layer_offset":
            return list(self.sys.plan_for(self.params["ids"]).tensors)
        return list(TRAINED_PLAN)

    def draft_copy(self, out: Path, src: Optional[Path] = None) -> Path:
        """The draft folder the server loads: the system's draft itself (``src`` when given), or a copy under ``out``
        with the damaged tensor, the permuted d2t, the shifted config ids, or the system's clean ids."""
        src = Path(src or self.sys.draft)
        ids = self.params["ids"] if self.cls == "layer_offset" else self.sys.clean_ids
        if self.cls not in ("tensor", "d2t") and ids is None:
            return src
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        for f in src.iterdir():
            if f.is_file():
                shutil.copy(f, out / f.name)
        if ids is not None:
            raw = json.loads((src / "config.json").read_text())
            raw["eagle_config"] = {**raw["eagle_config"], "eagle_aux_hidden_state_layer_ids": list(ids)}
            (out / "config.json").write_text(json.dumps(raw, indent=2))
        if self.cls not in ("tensor", "d2t"):
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
        """``python -m helpers server start`` flags: the engine and target of a system other than the Llama
        reference, the settings (vLLM: ``--steps`` = num_speculative_tokens), a ``--faults`` hook,
        ``--forward-hooks``."""
        s = self.settings
        args = [] if self.system is None or self.sys.name == "llama" else \
            ["--engine", self.sys.engine, "--target", str(self.sys.target)]
        args += ["--steps", str(s[0])]
        if self.sys.engine == "sglang":
            args += ["--topk", str(s[1]), "--draft-tokens", str(s[2])]
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


def draw(seed: int, cls: Optional[str] = None, classes: Sequence[str] = CLASSES,
         system: Optional[System] = None) -> GenFault:
    """One fault drawn from ``seed`` for ``system`` (None: the Llama reference): the class (``cls``, or uniform over
    ``classes``) and its parameters. Raises ValueError for a class unknown or not applicable to the system."""
    r = random.Random(seed)
    sysm = system or LLAMA
    cls = cls or r.choice([c for c in classes if c in sysm.classes] or list(classes))
    if cls not in STAGE or cls not in sysm.classes:
        raise ValueError(f"unknown fault class {cls!r} for system {sysm.name} (expected one of "
                         f"{', '.join(sysm.classes)})")
    p: dict = {}
    if cls == "tensor":
        p["tensor"] = r.choice(TENSORS if sysm.name == "llama" else sysm.tensors)
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
        base = list(sysm.clean_ids or TRAINED_IDS)
        while True:
            if r.random() < 0.5:
                s = r.choice((-2, -1, 1, 2))
                ids = [i + s for i in base]
            else:
                ids = list(base)
                c = r.randrange(3)
                ids[c] += r.choice((-2, -1, 1, 2))
            ids = sorted(ids)
            # ids the engine serves as another plan (Llama reference: -1 .. 6, capture index 0 .. 7, distinct)
            if sysm.wiring_ok(ids):
                break
        p["ids"] = ids
    elif cls == "chunk_order":
        order = [0, 1, 2]
        while order == [0, 1, 2]:
            r.shuffle(order)
        p["order"] = order
    elif cls == "settings" and sysm.engine == "vllm":     # a chain only: num_speculative_tokens
        s = r.choice((1, 2, 4, 5))
        p["settings"] = [s, 1, s + 1]
    elif cls == "settings":
        if r.random() < 0.5:
            s = r.choice((1, 2))
            p["settings"] = [s, 1, s + 1]
        else:
            s, k = r.choice((1, 2, 3)), r.choice((2, 3, 4))
            most = min(k + (s - 1) * k * k + 1, 8)
            p["settings"] = [s, k, r.randint(s + 1, most)]     # fewer than steps + 1: SGLang fails at verify
    elif cls == "hook":
        m = sysm.draft_only_modules
        mods = r.choice((m[:1], m[1:], m))
        p["modules"] = list(mods)
        p["configs"] = [{"noise": round(_loguniform(r, 0.05, 1.5), 3),
                         "scale": round(r.choice((1.0, 1.0, r.uniform(0.5, 2.0))), 3),
                         "seed": r.randrange(1000)} for _ in mods]
    return GenFault(seed, cls, p, system)


def draws(n: int, seed: int = 0, classes: Sequence[str] = CLASSES, system: Optional[System] = None) -> list[GenFault]:
    """``n`` faults from ``seed`` for ``system`` (None: the Llama reference): the classes in turn (every class appears
    once ``n >= len(classes)``; a class the system does not take is left out), each with its own seed and random
    strength."""
    r = random.Random(seed)
    order = [c for c in classes if c in (system or LLAMA).classes]
    if not order:
        raise ValueError(f"none of the classes {list(classes)} applies to system {(system or LLAMA).name} "
                         f"(expected some of {', '.join((system or LLAMA).classes)})")
    r.shuffle(order)
    return [draw(r.randrange(2 ** 31), order[i % len(order)], system=system) for i in range(n)]
