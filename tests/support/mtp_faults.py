"""Generated faults of an MTP / NextN head (the Kimi-class target's ``model.layers.8.*``), drawn from a seed: a class
and a strength, each knowing the stage of the NextN budget that should name it (test fixture, off by default; no
flag reaches it).

Classes (the stage that should name them in brackets, :data:`STAGE`):

* ``clean`` (none): no fault.
* ``eh_swap`` (draft): the two halves of ``eh_proj`` swapped (``[H, 2H]``: columns ``:H`` read ``enorm(embed)``,
  ``H:`` read ``hnorm(h)``, ``sglang/srt/models/deepseek_nextn.py::DeepseekModelNextN.forward``): the head of an
  export that concatenated the other way round.
* ``eh_scale`` (draft): one half of ``eh_proj`` (drawn) scaled by a factor drawn log-uniform in 1/16 .. 1/2 or
  2 .. 16: a wrong per-block quantisation scale.
* ``head_noise`` (draft): Gaussian noise of a fraction (log-uniform 0.2 .. 2) of each tensor's RMS on one drawn
  group of the head's own tensors (``eh_proj``; the MLA attention; the MoE experts; all of them).
* ``steps`` (settings): served with ``--speculative-num-steps`` 2 .. 4 (topk 1, steps + 1 draft tokens) where the
  head was trained for 1 (``nextn_training_log.json`` ``hyper.train_steps``).
* ``pre_norm`` (wiring, finding ``norm_mismatch``): the head fed the target's last layer output before the final
  norm (``helpers.hooks`` fault ``wrong_layer`` with layer ``num_hidden_layers - 1`` on the target's logits
  processor), where SGLang feeds the post-norm state (``deepseek_v2.py::DeepseekV2Model.forward``).

Checkpoint faults are written into a copy of the target folder (:func:`write_faulty_target`), the NextN layer
rewritten in its ``model.safetensors`` and every other tensor unchanged.
"""
from __future__ import annotations

import math
import random
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
from safetensors.torch import load_file, save_file

from . import ROOT

TARGET = ROOT / "env" / "models" / "kimi" / "target"
VALIDATION = ROOT / "env" / "models" / "kimi" / "data" / "validation"
CLASSES = ("clean", "eh_swap", "eh_scale", "head_noise", "steps", "pre_norm")
STAGE = {"clean": "none", "eh_swap": "draft", "eh_scale": "draft", "head_noise": "draft", "steps": "settings",
         "pre_norm": "wiring"}
NOISE_GROUPS = ("eh_proj", "attention", "experts", "all")


@dataclass
class MTPFault:
    """One drawn fault: ``kind`` (:data:`CLASSES`), its strength in ``params``, the stage that should name it."""

    seed: int
    kind: str
    params: dict = field(default_factory=dict)

    @property
    def stage(self) -> str:
        return STAGE[self.kind]

    @property
    def checkpoint(self) -> bool:
        """The fault is in the head's weights (a faulty target folder is written)."""
        return self.kind in ("eh_swap", "eh_scale", "head_noise")

    def label(self) -> str:
        p = ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in self.params.items())
        return f"{self.kind}" + (f" ({p})" if p else "")


def draw(seed: int, kinds: tuple[str, ...] = CLASSES) -> MTPFault:
    """The fault of ``seed``: a class uniform over ``kinds`` and its strength (module docstring)."""
    g = random.Random(seed)
    kind = g.choice(kinds)
    p: dict = {}
    if kind == "eh_scale":
        p["half"] = g.choice(("embed", "hidden"))
        e = g.uniform(1.0, 4.0)                                     # log2 of the factor's distance from 1
        p["factor"] = 2.0 ** (e if g.random() < 0.5 else -e)
    elif kind == "head_noise":
        p["group"] = g.choice(NOISE_GROUPS)
        p["fraction"] = math.exp(g.uniform(math.log(0.2), math.log(2.0)))
        p["noise_seed"] = g.randrange(2 ** 31)
    elif kind == "steps":
        p["steps"] = g.randint(2, 4)
    elif kind == "pre_norm":
        p["layer"] = 7                                             # num_hidden_layers - 1 of the Kimi-class target
    return MTPFault(seed, kind, p)


def _in_group(name: str, group: str) -> bool:
    if group == "all":
        return True
    if group == "eh_proj":
        return name.endswith("eh_proj.weight")
    if group == "attention":
        return ".self_attn." in name
    return ".mlp.experts." in name


def damage(w: dict[str, torch.Tensor], fault: MTPFault, layer: int) -> list[str]:
    """Apply a checkpoint fault to the target's tensors ``w`` in place (only ``model.layers.{layer}.*``, the head's
    own weights; never ``embed_tokens`` / ``shared_head.head``, the target's copies SGLang does not read). Returns the
    names changed.

    Raises:
        ValueError: ``fault`` is not a checkpoint fault."""
    p = f"model.layers.{layer}."
    eh = p + "eh_proj.weight"
    if fault.kind == "eh_swap":
        t = w[eh]
        H = t.shape[1] // 2
        w[eh] = torch.cat([t[:, H:], t[:, :H]], dim=1).contiguous()
        return [eh]
    if fault.kind == "eh_scale":
        t = w[eh].float().clone()
        H = t.shape[1] // 2
        sl = slice(0, H) if fault.params["half"] == "embed" else slice(H, 2 * H)
        t[:, sl] *= fault.params["factor"]
        w[eh] = t.to(w[eh].dtype)
        return [eh]
    if fault.kind == "head_noise":
        g = torch.Generator().manual_seed(int(fault.params["noise_seed"]))
        names = [k for k in w if k.startswith(p) and w[k].dim() == 2 and _in_group(k, fault.params["group"])
                 and not k.endswith(("embed_tokens.weight", "shared_head.head.weight"))]
        for k in names:
            t = w[k].float()
            rms = float(t.pow(2).mean().sqrt())
            w[k] = (t + torch.randn(t.shape, generator=g) * rms * fault.params["fraction"]).to(w[k].dtype)
        return names
    raise ValueError(f"{fault.kind} is not a checkpoint fault")


def write_faulty_target(fault: MTPFault, out: Path, target: Path = TARGET) -> Path:
    """A copy of ``target`` in ``out`` with ``fault`` in its NextN layer (``model.layers.{num_hidden_layers}.*``);
    the copy keeps the tokenizer, config and ``nextn_training_log.json``. Returns ``out``."""
    import json
    out = Path(out)
    shutil.copytree(target, out, dirs_exist_ok=True)
    layer = int(json.loads((target / "config.json").read_text())["num_hidden_layers"])
    w = load_file(str(target / "model.safetensors"))
    changed = damage(w, fault, layer)
    assert changed, f"fault {fault.label()} changed no tensor"
    save_file(w, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def served_steps(fault: MTPFault) -> int:
    """The ``--speculative-num-steps`` the fault serves (1 but for ``steps``)."""
    return int(fault.params.get("steps", 1))


def hook_faults(fault: MTPFault) -> list:
    """The ``helpers.hooks`` faults a server runs for ``fault`` (``pre_norm``: ``wrong_layer`` out(n-1)); [] for the
    others."""
    from helpers.hooks import Fault
    return [Fault("wrong_layer", chunk=0, layer=fault.params["layer"])] if fault.kind == "pre_norm" else []


def served_world(tmp: Path, n_prompts: int = 3, new_tokens: int = 24, target: Path = TARGET):
    """The recorded live side for the state faults: the target's (default the Kimi-class one) greedy continuations of
    ``n_prompts`` bundled prompts and their every-layer reference dump (HF transformers, :func:`helpers.capture.
    capture_reference_hf`). Returns ``(sequences, reference dump, final-norm weight, eps)``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from helpers.acceptance.prompts import load_prompts
    from helpers.capture import capture_reference_hf
    from helpers.draft.model import target_final_norm
    from helpers.draft.simulate import SimSequence
    tok = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    seqs = []
    for pr in load_prompts(None, n=n_prompts):
        ids = tok(pr.text)["input_ids"] if pr.input_ids is None else list(pr.input_ids)
        with torch.no_grad():
            toks = model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False,
                                  min_new_tokens=new_tokens)[0]
        seqs.append(SimSequence(pr.id, toks.clone(), torch.zeros(len(toks), 1), len(ids)))
    ref = capture_reference_hf(target, [{"id": s.key, "input_ids": s.tokens.tolist()} for s in seqs], tmp,
                               progress=False)
    w, eps = target_final_norm(target)
    return seqs, ref, w, eps


def served_states(world, fault: MTPFault) -> list:
    """The live sequences with the state a server with ``fault`` feeds the head: the post-norm state (SGLang's), or
    for ``pre_norm`` the reference's ``out(layer)`` (what the ``wrong_layer`` hook hands the logits processor)."""
    from helpers.draft.simulate import SimSequence
    from helpers.formats.dumps import read_dump
    from helpers.investigation.mtp import reference_sequences
    seqs, ref, w, eps = world
    refs = reference_sequences(ref, seqs, w, eps)
    if fault.kind != "pre_norm":
        return refs
    src = read_dump(ref)
    names = src.layer_plan["tensors"]
    i = names.index(f"out({fault.params['layer']})")
    by = {s.sample_id: s.load() for s in src.samples}
    H = refs[0].aux.shape[1]
    return [SimSequence(r.key, r.tokens, by[r.key][:r.aux.shape[0], i * H:(i + 1) * H].float(), r.start) for r in refs]


def offline_named(fault: MTPFault, tmp: Path, world, *, max_rows: int = 48) -> dict:
    """Run the NextN budget's stages offline (no server) on ``fault``: the draft stage
    (:func:`helpers.draft.nextn_stage.nextn_draft_stage` on the head of the faulty target copy, the committed
    validation rows, the served steps), the settings check (:func:`helpers.draft.nextn_stage.steps_check`) and the
    state identification (:func:`helpers.investigation.mtp.identify_state` on :func:`served_states`). Returns
    ``{"named": the stages that name a fault, "draft": the draft loss, "findings": the state findings' kinds,
    "settings": the settings check, "seconds"}``; ``named`` is ``["none"]`` when nothing is named and the draft
    stage is clear."""
    import time

    from helpers.draft.loader import load_draft
    from helpers.draft.nextn_stage import nextn_draft_stage, steps_check
    from helpers.investigation.mtp import identify_state, state_findings
    t0 = time.monotonic()
    folder = write_faulty_target(fault, tmp / f"target-{fault.seed}") if fault.checkpoint else TARGET
    head = load_draft(folder, folder)
    steps = served_steps(fault)
    ds = nextn_draft_stage(head, folder, steps, validation=VALIDATION, max_rows=max_rows)
    sc = steps_check(steps, ds["trained_steps"], ds["stage"])
    seqs, ref, w, eps = world
    served = served_states(world, fault)
    found = state_findings(identify_state(served, ref, w, eps), None)
    # the fault's cost measured another way: the head drafting chains on the live prompts' states (the budget's
    # "draft (offline, reference states)" stage), the faulty head against the clean one, paired per prompt
    from helpers.draft.budget import _paired_loss, _stage
    from helpers.draft.decide import threshold
    from helpers.draft.simulate import DraftSettings, simulate_sequences
    st = DraftSettings(steps, 1, steps + 1)
    refs = served_states(world, MTPFault(fault.seed, "clean"))
    n_new = max(len(x.tokens) - x.start for x in refs)
    sim = lambda h: simulate_sequences(h, refs, [st], max_new_tokens=n_new)["per_request"][st]  # noqa: E731
    clean = sim(load_draft(TARGET, TARGET)) if fault.checkpoint else None
    live_cost = None
    if clean is not None:
        d, lo, hi, n, _ = _paired_loss(clean, sim(head))
        al = _stage("clean", clean, steps, source="")["accept_length"]
        live_cost = {"delta": d, "ci": [lo, hi], "material": d >= threshold(al), "threshold": threshold(al)}
    named = []
    if ds["loss"]["decision"] == "counts":
        named.append("draft")
    if sc:
        named.append("settings")
    if found:
        named.append("wiring")
    if not named:
        named = ["none"] if ds["loss"]["decision"] == "clear" else ["undecided"]
    return {"named": named, "draft": {k: ds["loss"].get(k) for k in ("delta", "ci", "decision", "threshold")},
            "accept_length": ds["stage"].get("accept_length"), "findings": [f["kind"] for f in found],
            "settings": sc, "live_prompt_cost": live_cost, "seconds": round(time.monotonic() - t0, 1)}


__all__ = ["CLASSES", "MTPFault", "STAGE", "TARGET", "VALIDATION", "damage", "draw", "hook_faults", "offline_named",
           "served_states", "served_steps", "served_world", "write_faulty_target"]
