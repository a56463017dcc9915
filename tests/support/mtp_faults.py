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

The weights classes (:data:`WEIGHT_CLASSES`, drawn only when asked for: the default draw keeps the seeds of the
classes above):

* ``own_head`` -- the head's own ``model.layers.{N}.shared_head.head`` (``which`` ``head``) or ``embed_tokens``
  (``embed``) differs from the target's. Neither engine serves that copy (``helpers.draft.mtp_weights``).
  ``mode`` ``copy`` (weights: ``lm_head_replaced`` / ``embedding_replaced``): a stale copy, Gaussian noise of a
  fraction (log-uniform 0.01 .. 1) of its RMS; the head was trained with the shared one, so nothing is lost.
  ``mode`` ``trained`` (draft, and the weights finding): a head trained with its own copy, built exactly: the head
  computes what the clean head computes **with its own copy** and loses that when served with the target's. A
  fraction (log-uniform 0.05 .. 1) of the hidden units is permuted: for the lm_head, in the layer's whole residual
  stream and the own head's columns (:func:`_permute_layer`; exact at the first draft step, the only one served: a
  later step's ``hnorm`` reads the permuted state); for the embedding, in the own copy, ``enorm`` and the embedding
  half of ``eh_proj`` (exact: RMSNorm is blind to the order of the units).
* ``missing`` (weights: ``mtp_weights_missing``) -- tensors of the NextN layer left out of the checkpoint: the whole
  layer, 1-4 of the head's own tensors (``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm``), the attention, or
  1-4 experts (their three projections). SGLang 0.5.23 starts anyway (``helpers.draft.mtp_checks.
  sglang_missing_effect``); the offline head refuses to run (the parameters the engine serves are uninitialised
  memory), so the draft stage stays ``undecided``.

The engine class (:data:`ENGINE_CLASSES`, drawn only when asked for):

* ``current_token`` (engine, finding ``draft_extend_ids_unshifted``): the engine feeds the head's draft-extend rows
  the current token's embedding instead of the next one's (``tests/support/engine_faults.py`` fault
  ``embed_current_token``: SGLang's draft extend rotates the ids left by one, ``sglang/srt/speculative/
  eagle_worker_v2.py::EagleDraftWorker._draft_extend_for_prefill``, and a ``DRAFT_EXTEND_V2`` row holds the token
  verification emitted after it, ``_draft_extend_for_decode``; the fault undoes that). ``strength``: the share of
  draft-extend rows hit (by position), log-uniform 0.1 .. 1; ``hook_seed``: the hook's seed. The step trace names it
  (``helpers.draft.trace.current_token_hypothesis``).

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
WEIGHT_CLASSES = ("own_head", "missing")
ENGINE_CLASSES = ("current_token",)
STAGE = {"clean": "none", "eh_swap": "draft", "eh_scale": "draft", "head_noise": "draft", "steps": "settings",
         "pre_norm": "wiring", "own_head": "weights", "missing": "weights", "current_token": "engine"}
OWN_TENSORS = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight")
MISSING_GROUPS = ("layer", "own", "attention", "experts")
NOISE_GROUPS = ("eh_proj", "attention", "experts", "all")


@dataclass
class MTPFault:
    """One drawn fault: ``kind`` (:data:`CLASSES`), its strength in ``params``, the stage that should name it."""

    seed: int
    kind: str
    params: dict = field(default_factory=dict)

    @property
    def stage(self) -> str:
        """The stage whose loss the fault is (``own_head`` trained: ``draft``; a copy: ``weights``)."""
        if self.kind == "own_head" and self.params.get("mode") == "trained":
            return "draft"
        return STAGE[self.kind]

    @property
    def stages(self) -> tuple[str, ...]:
        """Every stage that should name the fault (a trained own head: the draft stage's loss and the weights
        check's finding)."""
        return ("draft", "weights") if self.stage == "draft" and self.kind == "own_head" else (self.stage,)

    @property
    def checkpoint(self) -> bool:
        """The fault is in the head's weights (a faulty target folder is written)."""
        return self.kind in ("eh_swap", "eh_scale", "head_noise", "own_head", "missing")

    def label(self) -> str:
        p = ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in self.params.items()
                      if k != "noise_seed")
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
    elif kind == "own_head":
        p["which"] = g.choice(("head", "embed"))
        p["mode"] = g.choice(("copy", "trained"))
        lo = 0.01 if p["mode"] == "copy" else 0.05
        p["fraction"] = math.exp(g.uniform(math.log(lo), math.log(1.0)))
        p["noise_seed"] = g.randrange(2 ** 31)
    elif kind == "missing":
        p["group"] = g.choice(MISSING_GROUPS)
        if p["group"] == "own":
            p["tensors"] = sorted(g.sample(OWN_TENSORS, g.randint(1, 4)))
        elif p["group"] == "experts":
            p["experts"] = sorted(g.sample(range(8), g.randint(1, 4)))   # of the Kimi-class target's 8
    elif kind == "current_token":
        p["strength"] = math.exp(g.uniform(math.log(0.1), math.log(1.0)))
        p["hook_seed"] = g.randrange(1 << 16)
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
    if fault.kind == "own_head":
        return _own_head(w, fault, p)
    if fault.kind == "missing":
        grp = fault.params["group"]
        if grp == "layer":
            names = [k for k in w if k.startswith(p)]
        elif grp == "own":
            names = [p + t for t in fault.params["tensors"]]
        elif grp == "attention":
            names = [k for k in w if k.startswith(p + "self_attn.")]
        else:
            names = [k for k in w if any(k.startswith(f"{p}mlp.experts.{e}.") for e in fault.params["experts"])]
        for k in names:
            del w[k]
        return names
    raise ValueError(f"{fault.kind} is not a checkpoint fault")


#: the NextN layer's tensors whose rows are in its hidden basis (outputs of width H) / whose columns are (inputs)
_ROWS_H = ("eh_proj.weight", "o_proj.weight", "down_proj.weight")
_COLS_H = ("q_a_proj.weight", "kv_a_proj_with_mqa.weight", "mlp.gate.weight", "gate_proj.weight", "up_proj.weight",
           "shared_head.head.weight")
_NORMS_H = ("input_layernorm.weight", "post_attention_layernorm.weight", "shared_head.norm.weight")


def _permute_layer(w: dict[str, torch.Tensor], p: str, perm: torch.Tensor) -> list[str]:
    """The NextN layer under ``p`` re-expressed in its hidden units permuted by ``perm`` (the layer's residual
    stream: ``eh_proj``'s output, the attention's and the MoE's outputs, their norms, the router's and the experts'
    inputs, ``shared_head.norm`` and the own lm_head's columns). ``enorm`` / ``hnorm`` and ``eh_proj``'s columns read
    the target's embedding and state, left as they are. With its own lm_head the layer computes the same logits; with
    the target's it reads the units in the wrong order. Returns the names changed."""
    out = []
    for k in [k for k in w if k.startswith(p)]:
        if k.endswith(_NORMS_H):
            w[k] = w[k][perm].contiguous()
        elif k.endswith(_ROWS_H):
            w[k] = w[k][perm].contiguous()
        elif k.endswith(_COLS_H):
            w[k] = w[k][:, perm].contiguous()
        else:
            continue
        out.append(k)
    return out


def _own_head(w: dict[str, torch.Tensor], fault: MTPFault, p: str) -> list[str]:
    """``own_head`` (module docstring) on the tensors ``w`` of the layer prefix ``p``; returns the names changed."""
    g = torch.Generator().manual_seed(int(fault.params["noise_seed"]))
    which = fault.params["which"]
    own = p + ("shared_head.head.weight" if which == "head" else "embed_tokens.weight")
    t = w[own].float()
    if fault.params["mode"] == "copy":
        rms = float(t.pow(2).mean().sqrt())
        w[own] = (t + torch.randn(t.shape, generator=g) * rms * fault.params["fraction"]).to(w[own].dtype)
        return [own]
    H = t.shape[1]
    k = max(2, round(fault.params["fraction"] * H))
    units = torch.randperm(H, generator=g)[:k]
    perm = torch.arange(H)
    perm[units] = units.roll(1)                     # each chosen unit takes the next one's place: no fixed point
    if which == "head":
        return _permute_layer(w, p, perm)
    en, eh = p + "enorm.weight", p + "eh_proj.weight"
    w[own] = t[:, perm].contiguous().to(w[own].dtype)
    w[en] = w[en][perm].contiguous()
    e = w[eh].clone()
    e[:, :H] = e[:, :H][:, perm]
    w[eh] = e.contiguous()
    return [own, en, eh]


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


def engine_hook_specs(fault: MTPFault, arm: Optional[str] = None) -> list[dict]:
    """The SGLang ``--forward-hooks`` specs of an engine class (``current_token``: ``tests/support/engine_faults.py``
    ``embed_current_token`` with the drawn strength and seed; ``arm``: acts only while that file exists, a JSON object
    in it overriding strength and seed); [] for the others."""
    if fault.kind != "current_token":
        return []
    from .engine_faults import spec
    extra = {"arm": arm} if arm is not None else {}
    return [spec("embed_current_token", strength=fault.params["strength"], seed=fault.params["hook_seed"], **extra)]


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
    state identification (:func:`helpers.investigation.mtp.identify_state` on :func:`served_states`) and the weights
    check (:func:`helpers.draft.mtp_weights.head_weight_findings`, stage ``weights``). Returns ``{"named": the
    stages that name a fault, "draft": the draft loss, "findings": the state and weights findings' kinds,
    "weights": those findings, "settings": the settings check, "seconds"}``; ``named`` is ``["none"]`` when
    nothing is named and the draft stage is clear. A head the offline loader refuses (missing tensors) leaves the
    draft stage ``undecided`` with the reason."""
    import time

    from helpers.draft.budget import _paired_loss, _stage
    from helpers.draft.decide import threshold
    from helpers.draft.loader import load_draft
    from helpers.draft.mtp_weights import head_weight_findings
    from helpers.draft.nextn_stage import nextn_draft_stage, steps_check
    from helpers.draft.simulate import DraftSettings, simulate_sequences
    from helpers.errors import BadInput
    from helpers.investigation.mtp import identify_state, state_findings
    t0 = time.monotonic()
    folder = write_faulty_target(fault, tmp / f"target-{fault.seed}") if fault.checkpoint else TARGET
    weights = head_weight_findings(folder, folder)
    steps = served_steps(fault)
    try:
        head = load_draft(folder, folder)
    except BadInput as e:                       # a head with missing tensors: the engine serves uninitialised memory
        head, why = None, str(e)
    if head is not None:
        ds = nextn_draft_stage(head, folder, steps, validation=VALIDATION, max_rows=max_rows)
        loss, trained, stage = ds["loss"], ds["trained_steps"], ds["stage"]
    else:
        loss, stage = {"delta": None, "ci": None, "decision": "undecided", "threshold": None,
                       "why": f"the head cannot run offline: {why}"}, {"accept_length": None}
        trained = 1
    sc = steps_check(steps, trained, stage if head is not None else None)
    seqs, ref, w, eps = world
    served = served_states(world, fault)
    found = state_findings(identify_state(served, ref, w, eps), None)
    # the fault's cost measured another way: the head drafting chains on the live prompts' states (the budget's
    # "draft (offline, reference states)" stage), the faulty head against the clean one, paired per prompt
    st = DraftSettings(steps, 1, steps + 1)
    refs = served_states(world, MTPFault(fault.seed, "clean"))
    n_new = max(len(x.tokens) - x.start for x in refs)
    sim = lambda h: simulate_sequences(h, refs, [st], max_new_tokens=n_new)["per_request"][st]  # noqa: E731
    clean = sim(load_draft(TARGET, TARGET)) if fault.checkpoint and head is not None else None
    live_cost = None
    if clean is not None:
        d, lo, hi, n, _ = _paired_loss(clean, sim(head))
        al = _stage("clean", clean, steps, source="")["accept_length"]
        live_cost = {"delta": d, "ci": [lo, hi], "material": d >= threshold(al), "threshold": threshold(al)}
    named = []
    if loss["decision"] == "counts":
        named.append("draft")
    if sc:
        named.append("settings")
    if found:
        named.append("wiring")
    if weights:
        named.append("weights")
    if not named:
        named = ["none"] if loss["decision"] == "clear" else ["undecided"]
    return {"named": named, "draft": {k: loss.get(k) for k in ("delta", "ci", "decision", "threshold", "why")},
            "accept_length": stage.get("accept_length"), "findings": [f["kind"] for f in found + weights],
            "weights": [{k: f.get(k) for k in ("kind", "detail")} for f in weights],
            "settings": sc, "live_prompt_cost": live_cost, "seconds": round(time.monotonic() - t0, 1)}


__all__ = ["CLASSES", "ENGINE_CLASSES", "WEIGHT_CLASSES", "engine_hook_specs", "MTPFault", "STAGE", "TARGET", "VALIDATION", "damage", "draw", "hook_faults", "offline_named",
           "served_states", "served_steps", "served_world", "write_faulty_target"]
