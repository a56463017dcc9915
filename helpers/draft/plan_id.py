"""The layer plan a draft was trained on, identified from the draft itself when its training data is not at hand.

An EAGLE-3 draft's ``fc`` was trained on one plan: the target tensors (``embedding``, ``out(L)``; DESIGN.md "Words")
concatenated in one order. Its config's ``eagle_aux_hidden_state_layer_ids`` say which ids, but not in which
convention they were written (SpecForge ``out(i)``, SGLang's capture index / vLLM / EAGLE ``in(i)``,
:mod:`helpers.layers.ids`), and a wrong config is one of the faults this tool looks for, so the config cannot decide.
The checkpoint can: run teacher-forced on the target's own continuations of a few prompts (sampled, as drafts are
trained), with the aux states taken from an every-layer reference of those tokens under each candidate plan, it does
best (lowest loss) under the plan it was trained on.

For every candidate the draft is run as SGLang runs it (:class:`helpers.draft.model.Eagle3Draft`: the draft-extend pass,
row t taking token t+1 with the aux state of position t) and scored by what its trainer minimised: the soft
cross-entropy against the target's next-token distribution over the draft vocabulary (SpecForge ``ploss_0``; the
distribution is the target's own, lm_head(norm(out(n-1))) of the reference), per continuation row. A loss, not an
argmax statistic: in a small target neighbouring residual streams are close (out(3) vs out(4) ~0.3 relative), and
on a few prompts the draft's argmax (hence its accept length) often does not change between them while its loss does.
The CI of each loss, and of the margin of the best plan over each other plan, are percentile bootstraps over sequences
(paired: every plan is resampled on the same sequences). The best plan is ``identified`` only when its margin over
EVERY other candidate has a CI above zero; else ``undecided`` (never a guess). The teacher-forced accept length of a
chain (:func:`helpers.draft.simulate._teacher_forced` against the target's greedy token) is measured for the best
plan, the runner-up and the config's readings, and reported with its CI.

Candidates (:func:`candidate_plans`): the config's ids read under each convention; the trainers' defaults
(SpecForge ``[1, n//2-1, n-4]`` out(i); SGLang's fallback / vLLM / EAGLE ``[2, n//2, n-3]`` in(i)); around each of
those, every chunk moved by +-1, the whole plan moved by +-1, the embedding prepended (last chunk dropped) and in
place of the first chunk, and every other chunk order. After they are scored, the neighbourhood of the best (the same
moves) is scored too, until the best no longer changes (at most ``rounds``): the checkpoint, not the config, decides.

Speed: the candidates of a sequence run stacked in one draft-extend pass (:meth:`helpers.draft.model.Eagle3Draft.
extend_many`: the same figures, bit for bit, as one pass per candidate); a ``memo`` keeps each sequence's figures
for a later call on more sequences (``investigate``'s second round).
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from ..errors import BadInput
from ..formats.dumps import read_dump, write_dump
from ..layers.ids import EMBEDDING, out, parse_tensor, physical, specforge_default_ids, \
    vllm_default_ids
from .attention import _rms
from .model import Eagle3Draft, compute_threads, target_final_norm, target_lm_head
from .simulate import SimSequence, _chain_accepts, _teacher_forced
from .teacher_forced import target_view

#: what every output says of a plan found this way (the investigation's sentence, JSON and postmortem)
PROVENANCE = "plan identified from the draft's behaviour, not read from training data"
#: what an undecided identification says in its place (it names no plan: nothing was identified)
UNDECIDED_PROVENANCE = "measured on the draft's behaviour, no training data read"
#: conventions whose readings of a config id differ: ``sglang_capture`` / ``vllm`` / ``eagle3`` all read in(i)
_READINGS = (("specforge", "SpecForge out(i)"), ("vllm", "in(i) (SGLang capture index, vLLM, EAGLE)"),
             ("hf", "HF hidden_states index"))


# ---------------------------------------------------------------------------------------------------- inputs

@dataclass
class LayerStates:
    """Every layer of the target for one sequence: the target's own continuation of a prompt.

    Attributes:
        key: sequence id (prompt id).
        tokens: int64 ``[T]``, the prompt then the target's greedy continuation.
        start: index of the first generated token (rows from ``start - 1`` are scored).
        names: the physical tensor of each slot of ``states`` (``embedding``, ``out(0)`` .. ``out(n-1)``).
        states: ``[T, K, H]`` (any float dtype), ``states[t, j]`` = tensor ``names[j]`` at position t.
    """

    key: str
    tokens: torch.Tensor
    start: int
    names: tuple[str, ...]
    states: torch.Tensor

    def aux(self, plan: Sequence[str]) -> torch.Tensor:
        """``[T, len(plan) * H]``: the plan's tensors concatenated in plan order (what a server feeds the draft).

        Raises:
            KeyError: a tensor of ``plan`` is not in ``names``."""
        idx = [self.names.index(t) if t in self.names else _missing(t, self.names) for t in plan]
        return self.states[:, idx, :].reshape(self.states.shape[0], -1)

    def aux_many(self, plans: Sequence[Sequence[str]]) -> torch.Tensor:
        """``[len(plans), T, K * H]``: :meth:`aux` of each plan (all of ``K`` chunks), stacked on dim 0 (the sets of
        :meth:`helpers.draft.model.Eagle3Draft.extend_many`).

        Raises:
            KeyError: a tensor of a plan is not in ``names``."""
        idx = torch.tensor([[self.names.index(t) if t in self.names else _missing(t, self.names) for t in p]
                            for p in plans], dtype=torch.long)                              # [B, K]
        return self.states[:, idx, :].permute(1, 0, 2, 3).reshape(len(plans), self.states.shape[0], -1)


def _missing(t: str, names: Sequence[str]) -> int:
    raise KeyError(f"the every-layer reference holds no {t!r} (it has {', '.join(names[:4])}, ...)")


def reference_from_dump(path: str | Path, *, starts: Optional[dict[str, int]] = None) -> list[LayerStates]:
    """The every-layer reference dump of a server (``server start --capture-layers``, the engine adapter's
    ``capture_every_layer``) or of HF transformers (:func:`helpers.capture.capture_reference_hf`) as
    :class:`LayerStates`: the chunks its ``layer_plan.tensors`` names, each ``hidden_size`` wide. The continuation
    starts at ``starts[sample id]`` when given, else at the sample's ``num_prompt_tokens``.

    Raises:
        BadInput: the dump names no tensors, its width is not ``len(tensors) * hidden_size``, or a sample has no
            continuation (the manifest named)."""
    src = read_dump(path)
    names = tuple((src.layer_plan or {}).get("tensors") or ())
    if not names:
        raise BadInput("the dump's layer_plan names no tensors: expected an every-layer reference",
                       path=Path(path) / "manifest.json", field="layer_plan.tensors")
    H = src.hidden_size or (src.width // len(names))
    if src.width != H * len(names):
        raise BadInput(f"{src.width} wide, expected {len(names)} tensors x {H}", path=Path(path) / "manifest.json",
                       field="layer_plan.tensors")
    out_seqs = []
    for s in src.samples:
        sid = str(s.sample_id or s.key)
        ids = np.asarray(s.input_ids).reshape(-1)
        start = (starts or {}).get(sid) or s.num_prompt_tokens
        if start is None or not 1 <= int(start) <= len(ids) - 2 or s.first_position:
            raise BadInput(f"sample {sid}: no continuation to score (prompt tokens {start}, {len(ids)} tokens)",
                           path=Path(path) / "manifest.json", field="num_prompt_tokens")
        rows = s.load()
        out_seqs.append(LayerStates(sid, torch.as_tensor(ids, dtype=torch.long), int(start), names,
                                    rows.reshape(rows.shape[0], len(names), H)))
    return out_seqs


@torch.no_grad()
def reference_from_hf(target_dir: str | Path, prompts: Sequence[Sequence[int]], *, new_tokens: int = 48,
                      temperature: float = 0.0, seed: int = 0, dtype: torch.dtype = torch.float32
                      ) -> list[LayerStates]:
    """The target's own continuation of each prompt (token ids; greedy at ``temperature`` 0, else sampled from its
    softmax at that temperature with ``seed``) and every layer of it, from HF transformers on CPU: ``embedding`` =
    ``hidden_states[0]``, ``out(L)`` = ``hidden_states[L+1]`` for L < n-1 and the input of ``model.norm`` for
    ``out(n-1)`` (as :func:`helpers.capture.capture_reference_hf`; transformers
    ``models/llama/modeling_llama.py::LlamaModel.forward``). EOS is not a stop (as the live prompts' ``ignore_eos``).

    Raises:
        BadInput: a prompt of no token, ``new_tokens`` < 2 or a negative temperature."""
    # lazy: transformers takes seconds to import; only HF needs it
    from ..formats.hf_target import every_layer_states, load_hf_target

    if new_tokens < 2 or temperature < 0:
        raise BadInput(f"new_tokens {new_tokens}, temperature {temperature}: expected >= 2 and >= 0",
                       field="new_tokens")
    model = load_hf_target(target_dir, dtype)
    n = model.config.num_hidden_layers
    names = (EMBEDDING,) + tuple(out(i) for i in range(n))
    g = torch.Generator().manual_seed(seed)
    seqs = []
    hidden = int(model.config.hidden_size)
    # a tiny target: one thread (2 threads on 2 loaded cores: 4x slower)
    with compute_threads(hidden * int(getattr(model.config, "intermediate_size", 4 * hidden))):
        for j, p in enumerate(prompts):
            ids = [int(x) for x in p]
            if not ids:
                raise BadInput(f"prompt {j}: no tokens", field="prompts")
            toks = list(ids)
            res = model(torch.tensor([ids]), use_cache=True)
            for _ in range(new_tokens):
                lg = res.logits[0, -1].float()
                nxt = int(lg.argmax()) if temperature == 0 else \
                    int(torch.multinomial(torch.softmax(lg / temperature, -1), 1, generator=g))
                toks.append(nxt)
                res = model(torch.tensor([[nxt]]), past_key_values=res.past_key_values, use_cache=True)
            st = torch.stack(every_layer_states(model, toks), dim=1).float()                   # [T, n+1, H]
            seqs.append(LayerStates(f"p{j}", torch.tensor(toks), len(ids), names, st))
    return seqs


# ---------------------------------------------------------------------------------------------- candidates

@dataclass(frozen=True)
class Candidate:
    """One plan to try: ``plan`` (tensors in chunk order) and ``origins`` (why it is a candidate)."""

    plan: tuple[str, ...]
    origins: tuple[str, ...]


def _valid(plan: Sequence[str], num_layers: int) -> bool:
    if len(set(plan)) != len(plan):
        return False
    for t in plan:
        kind, layer = parse_tensor(t)
        if kind == "final_norm" or (kind == "out" and not 0 <= int(layer) <= num_layers - 1):
            return False
    return True


def _shift(t: str, d: int, num_layers: int) -> Optional[str]:
    kind, layer = parse_tensor(t)
    L = -1 if kind == EMBEDDING else layer
    if kind == "final_norm":
        return None
    L = L + d
    if L == -1:
        return EMBEDDING
    return out(L) if 0 <= L <= num_layers - 1 else None


def neighbours(plan: Sequence[str], num_layers: int) -> list[tuple[tuple[str, ...], str]]:
    """The plans one move from ``plan`` (module docstring): each chunk +-1, the whole plan +-1, the embedding
    prepended (last chunk dropped) and in place of the first chunk, every other chunk order. Returns
    ``(plan, move)`` pairs, invalid plans (a tensor past the target, a tensor twice) left out."""
    plan = tuple(plan)
    outp: list[tuple[tuple[str, ...], str]] = []
    for c in range(len(plan)):
        for d in (-1, 1):
            t = _shift(plan[c], d, num_layers)
            if t is not None:
                outp.append((plan[:c] + (t,) + plan[c + 1:], f"chunk {c} {d:+d}"))
    for d in (-1, 1):
        moved = [_shift(t, d, num_layers) for t in plan]
        if None not in moved:
            outp.append((tuple(moved), f"every chunk {d:+d}"))
    outp.append(((EMBEDDING,) + plan[:-1], "embedding first, last chunk dropped"))
    outp.append(((EMBEDDING,) + plan[1:], "embedding in place of chunk 0"))
    for perm in itertools.permutations(range(len(plan))):
        if list(perm) != list(range(len(plan))):
            outp.append((tuple(plan[i] for i in perm), f"chunk order {list(perm)}"))
    return [(p, why) for p, why in outp if _valid(p, num_layers)]


def candidate_plans(config_ids: Optional[Sequence[int]], num_layers: int, num_aux: int) -> list[Candidate]:
    """The candidate plans for a draft whose config says ``config_ids`` (None: no ids) on a ``num_layers``-layer
    target, for ``num_aux`` aux chunks (module docstring): the bases (each convention's reading of the config ids,
    the trainers' defaults) and every plan one move from a base (:func:`neighbours`), deduplicated with all origins.

    Raises:
        BadInput: ``num_aux`` < 1 or no base plan of ``num_aux`` chunks exists."""
    if num_aux < 1:
        raise BadInput(f"num_aux {num_aux}: expected >= 1", field="num_aux_hidden_states")
    n = int(num_layers)
    bases: list[tuple[tuple[str, ...], str]] = []
    if config_ids:
        for conv, word in _READINGS:
            try:
                p = tuple(physical(i, conv, n) for i in config_ids)
            except ValueError:
                continue
            bases.append((p, f"config ids {list(config_ids)} read as {word}"))
    sf, vl = specforge_default_ids(n), vllm_default_ids(n)
    bases.append((tuple(sf.tensors(n)), f"SpecForge default {sf}"))
    bases.append((tuple(vl.tensors(n)), f"SGLang fallback / vLLM / EAGLE default {vl}"))
    found: dict[tuple[str, ...], list[str]] = {}

    def add(p: tuple[str, ...], why: str) -> None:
        if len(p) == num_aux and _valid(p, n):
            found.setdefault(p, [])
            if why not in found[p]:
                found[p].append(why)

    for p, why in bases:
        add(p, why)
    if not found:
        raise BadInput(f"no candidate plan of {num_aux} chunks on a {n}-layer target (config ids "
                       f"{list(config_ids or [])})", field="eagle_aux_hidden_state_layer_ids")
    for p, why in bases:
        if len(p) == num_aux and _valid(p, n):
            for q, move in neighbours(p, n):
                add(q, f"{why}, {move}")
    return [Candidate(p, tuple(w)) for p, w in found.items()]


# ------------------------------------------------------------------------------------------------- scoring

@dataclass
class PlanScore:
    """One candidate scored over every sequence (step 0: the draft-extend pass, where the aux states enter).

    Attributes:
        plan / origins: the candidate.
        loss / loss_ci: the draft's soft cross-entropy (nats) against the target's next-token distribution restricted
            to the draft vocabulary (SpecForge ``ploss_0``: ``specforge/algorithms/eagle3/model.py::Eagle3Model.
            _acc_and_loss`` with ``_compute_target_p``), per continuation row, and its 95 % CI over sequences.
        acc0: step-0 accuracy (the draft's first token == the target's argmax).
        hits / rows / loss_sum: per-sequence sums ``[n]`` (paired comparisons on the same resamples).
        accept_length / accept_length_ci: the teacher-forced accept length of a chain (:func:`_accept_lengths`), set
            for the best plan, the runner-up and the config's readings only (None otherwise).
    """

    plan: tuple[str, ...]
    origins: tuple[str, ...]
    loss: float
    loss_ci: tuple[float, float]
    acc0: float
    hits: np.ndarray = field(repr=False)
    rows: np.ndarray = field(repr=False)
    loss_sum: np.ndarray = field(repr=False)
    accept_length: Optional[float] = None
    accept_length_ci: Optional[tuple[float, float]] = None
    accepted: Optional[np.ndarray] = field(default=None, repr=False)
    al_rows: Optional[np.ndarray] = field(default=None, repr=False)

    def loss_draws(self, idx: np.ndarray) -> np.ndarray:
        """``[B]`` the loss on the resamples ``idx [B, n]``."""
        return self.loss_sum[idx].sum(1) / np.maximum(self.rows[idx].sum(1), 1.0)

    def to_json(self) -> dict:
        return {"plan": list(self.plan), "origins": list(self.origins), "loss": round(self.loss, 5),
                "loss_ci": [round(x, 5) for x in self.loss_ci], "step0_accuracy": round(self.acc0, 4),
                "accept_length": None if self.accept_length is None else round(self.accept_length, 4),
                "accept_length_ci": None if self.accept_length_ci is None else
                [round(x, 4) for x in self.accept_length_ci]}


@dataclass
class PlanIdentification:
    """What :func:`identify_plan` found.

    Attributes:
        decision: ``identified`` (the best plan's loss margin over EVERY other candidate has a 95 % CI above 0) or
            ``undecided``.
        plan: the best plan when identified, else None (never a guess).
        best / runner_up: the two lowest-loss candidates (``runner_up`` None with one candidate).
        margin / margin_ci: runner-up's loss minus best's (nats, > 0 when best is better) and its paired 95 % CI over
            sequences; al_margin / al_margin_ci: best's accept length minus runner-up's, paired CI.
        closest / closest_ci: the candidate whose margin CI comes nearest 0 (it decides ``undecided``).
        scores: every candidate scored, best first.
        steps / sequences / rows / rounds: chain length of the accept length, sequences, scored rows per plan,
            neighbourhood rounds run (``search_rounds`` in :meth:`to_json`).
        config_reading: which convention's reading of the config ids names the identified plan (None: none does).
        seconds: wall time of the offline passes (``offline_seconds`` in :meth:`to_json`).
        provenance: :data:`PROVENANCE` (an undecided one says :data:`UNDECIDED_PROVENANCE` in its sentence and JSON).
    """

    decision: str
    plan: Optional[tuple[str, ...]]
    best: PlanScore
    runner_up: Optional[PlanScore]
    margin: Optional[float]
    margin_ci: Optional[tuple[float, float]]
    al_margin: Optional[float]
    al_margin_ci: Optional[tuple[float, float]]
    closest: Optional[PlanScore]
    closest_ci: Optional[tuple[float, float]]
    scores: list[PlanScore]
    steps: int
    sequences: int
    rows: int
    rounds: int
    seconds: float
    config_reading: Optional[str] = None
    provenance: str = PROVENANCE

    def sentence(self) -> str:
        """One line: the plan (or why undecided), its loss and accept length, the margin, the provenance."""
        b = self.best
        head = (f"layer plan [{', '.join(self.plan)}] identified" if self.decision == "identified" else
                "layer plan undecided")
        txt = f"{head}: the draft's loss {b.loss:.4f} nats under [{', '.join(b.plan)}]"
        if b.accept_length is not None:
            txt += (f" (teacher-forced accept length {b.accept_length:.2f} [{b.accept_length_ci[0]:.2f}, "
                    f"{b.accept_length_ci[1]:.2f}])")
        if self.runner_up is not None:
            m, ci = self.margin, self.margin_ci
            txt += (f"; {m:+.4f} [{ci[0]:+.4f}, {ci[1]:+.4f}] nats better than the runner-up "
                    f"[{', '.join(self.runner_up.plan)}]")
            if self.al_margin is not None:
                txt += (f" (accept length {self.al_margin:+.2f} [{self.al_margin_ci[0]:+.2f}, "
                        f"{self.al_margin_ci[1]:+.2f}])")
        if self.decision != "identified" and self.closest is not None:
            txt += (f"; [{', '.join(self.closest.plan)}] is within the CI ({self.closest_ci[0]:+.4f} .. "
                    f"{self.closest_ci[1]:+.4f}), so no plan is named")
        if self.config_reading:
            txt += f"; it is {self.config_reading}"
        how = self.provenance if self.decision == "identified" else UNDECIDED_PROVENANCE
        return (txt + f" ({how}: the checkpoint run teacher-forced on {self.sequences} continuation(s) of "
                f"the target, {len(self.scores)} candidate plans)")

    def to_json(self) -> dict:
        def ci(x):
            return None if x is None else [round(float(v), 5) for v in x]
        return {"decision": self.decision, "plan": None if self.plan is None else list(self.plan),
                "best": self.best.to_json(),
                "runner_up": None if self.runner_up is None else self.runner_up.to_json(),
                "margin": self.margin, "margin_ci": ci(self.margin_ci), "accept_length_margin": self.al_margin,
                "accept_length_margin_ci": ci(self.al_margin_ci),
                "closest": None if self.closest is None else self.closest.to_json(), "closest_ci": ci(self.closest_ci),
                "scores": [s.to_json() for s in self.scores], "steps": self.steps, "sequences": self.sequences,
                "rows": self.rows, "search_rounds": self.rounds, "offline_seconds": round(self.seconds, 2),
                "config_reading": self.config_reading, "provenance": self.provenance if self.decision == "identified" else UNDECIDED_PROVENANCE,
                "sentence": self.sentence(),
                "method": "each candidate plan's tensors taken from an every-layer reference of the target's own "
                          "continuations; the draft run teacher-forced (draft-extend) and scored by its soft "
                          "cross-entropy against the target's distribution (SpecForge ploss_0); 95 % percentile "
                          "bootstrap over sequences, paired across plans"}


@dataclass
class TargetHead:
    """What turns the target's pre-norm ``out(n-1)`` into its next-token distribution: the final RMSNorm weight
    ``[H]`` and eps, and lm_head ``[V, H]`` (``sglang/srt/layers/logits_processor.py::LogitsProcessor``: logits =
    lm_head(norm(out(n-1))))."""

    norm: torch.Tensor
    eps: float
    lm_head: torch.Tensor

    @classmethod
    def load(cls, target_dir: str | Path) -> "TargetHead":
        """Read the final norm (:func:`helpers.draft.model.target_final_norm`) and the lm_head
        (:func:`helpers.draft.model.target_lm_head`)
        from the target folder's safetensors index (nothing else of the target is read).

        Raises:
            BadInput: no ``model.norm.weight`` (or lm_head) in the target's safetensors."""
        norm, eps = target_final_norm(target_dir)
        return cls(norm, eps, target_lm_head(target_dir)[0])

    def view(self, pre_norm: torch.Tensor, hot: Optional[torch.Tensor]):
        """:func:`helpers.draft.teacher_forced.target_view` of ``pre_norm`` ``[T, H]`` (out(n-1))."""
        return target_view(_rms(pre_norm.float(), self.norm, self.eps), self.lm_head, hot)


@torch.no_grad()
def _views(draft: Eagle3Draft, refs: Sequence[LayerStates], head: TargetHead, n_layers: int) -> list:
    hot = draft.hot_token_id.cpu().to(torch.long) if draft.hot_token_id is not None else (
        torch.arange(draft.arch.draft_vocab) if draft.arch.draft_vocab < draft.arch.vocab else None)
    return [head.view(r.states[:, r.names.index(out(n_layers - 1))], hot) for r in refs]


#: at most this many float32 logits (sets x rows x draft vocab) in one batched draft-extend pass: 2^25, 128 MiB
BATCH_LOGITS = 1 << 25


def _groups(n: int, T: int, draft: Eagle3Draft, batch: bool) -> list[range]:
    """The candidates ``0 .. n-1`` in groups run as one :meth:`Eagle3Draft.extend_many` each on a sequence of ``T``
    rows: every candidate alone when not ``batch``, else as many as :data:`BATCH_LOGITS` allows."""
    size = max(1, BATCH_LOGITS // max(1, T * draft.arch.draft_vocab)) if batch else 1
    return [range(a, min(n, a + size)) for a in range(0, n, size)]


def _extends(draft: Eagle3Draft, r: LayerStates, plans: Sequence[Sequence[str]], batch: bool):
    """The draft-extend pass over ``r``'s continuation under each plan (row t: token t+1 with the aux state of
    position t), per group of plans (:func:`_groups`: the plans of a group stacked on the batch dim of one pass, or
    one pass per plan when ``batch`` is false; identical results): yields ``(plan indices, their
    :class:`helpers.draft.model.ExtendOutput` in that order)``."""
    T = int(r.tokens.shape[0])
    for g in _groups(len(plans), T - 1, draft, batch):
        yield g, draft.extend_many(r.tokens[1:], r.aux_many([plans[c] for c in g])[:, : T - 1])


@torch.no_grad()
def _score(draft: Eagle3Draft, refs: Sequence[LayerStates], views: list, cands: Sequence[Candidate],
           idx: np.ndarray, batch: bool = True, memo: Optional[dict] = None) -> list[PlanScore]:
    """Each candidate's draft-extend over every sequence: per-sequence summed loss (soft cross-entropy against the
    target's distribution over the draft vocabulary) and step-0 hits (draft argmax == the target's argmax). With
    ``batch`` the candidates of a sequence run stacked in one pass (:func:`_extends`). ``memo`` (see
    :func:`identify_plan`): a sequence's figures under a plan found there are taken, not computed again."""
    n, C = len(refs), len(cands)
    hit0, rows, ns = (np.zeros((C, n)) for _ in range(3))
    memo = {} if memo is None else memo
    for j, (r, (full_arg, _ra, _inv, restr_p)) in enumerate(zip(refs, views)):
        T = int(r.tokens.shape[0])
        t = torch.arange(r.start - 1, T - 2)                    # row t: token t+1, predicts position t+2
        p_t, arg_t = restr_p[t + 1], full_arg[t + 1]
        todo = []
        for c, x in enumerate(cands):
            got = memo.get((id(draft), id(r), x.plan))
            if got is not None and got[0] is r and got[1] is draft:     # the objects themselves (no id reused)
                ns[c, j], hit0[c, j], rows[c, j] = got[2:]
            else:
                todo.append(c)
        for g, exts in _extends(draft, r, [cands[c].plan for c in todo], batch):
            lg = torch.stack([e.logits[t] for e in exts]).float().cpu()                   # [group, rows, V_draft]
            lp = torch.log_softmax(lg, dim=-1)
            hits = (draft.to_target_ids(lg.argmax(-1)) == arg_t).sum(-1)
            for k, i in enumerate(g):
                c = todo[i]
                ns[c, j] = float(-(p_t * lp[k]).sum())
                hit0[c, j], rows[c, j] = float(hits[k]), len(t)
                memo[(id(draft), id(r), cands[c].plan)] = (r, draft, ns[c, j], hit0[c, j], rows[c, j])
    out_scores = []
    for c, x in enumerate(cands):
        ld = ns[c][idx].sum(1) / np.maximum(rows[c][idx].sum(1), 1.0)
        out_scores.append(PlanScore(x.plan, x.origins, float(ns[c].sum() / max(rows[c].sum(), 1.0)), _pct(ld),
                                    float(hit0[c].sum() / max(rows[c].sum(), 1.0)), hit0[c], rows[c], ns[c]))
    return out_scores


@torch.no_grad()
def _accept_lengths(draft: Eagle3Draft, refs: Sequence[LayerStates], views: list, plans: Sequence[Sequence[str]],
                    steps: int, idx: np.ndarray, batch: bool = True
                    ) -> list[tuple[float, tuple[float, float], np.ndarray, np.ndarray]]:
    """The teacher-forced accept length of a chain of ``steps`` under each of ``plans`` (1 + leading correct drafts
    from every continuation row, against the target's greedy token: :func:`helpers.draft.simulate._teacher_forced`
    with the target's argmax as ``targets``), its 95 % CI over sequences and the per-sequence ``(accepted, rows)``,
    one tuple per plan. The draft-extend passes of the plans run stacked with ``batch`` (:func:`_extends`); the chain
    after each is per plan."""
    P = len(plans)
    acc, rows = np.zeros((P, len(refs))), np.zeros((P, len(refs)))
    for j, (r, (full_arg, *_)) in enumerate(zip(refs, views)):
        T = int(r.tokens.shape[0])
        y = torch.cat([r.tokens[:1], full_arg[: T - 1]])            # y[j] = the target's argmax after x_0..x_{j-1}
        for g, exts in _extends(draft, r, plans, batch):
            for c, ext in zip(g, exts):
                seq = SimSequence(r.key, r.tokens, r.aux(plans[c]), r.start, y)
                match = _teacher_forced(draft, ext, seq, steps, y)
                cont = (np.arange(T - 1) >= r.start - 1) & (match[0] >= 0)
                acc[c, j], rows[c, j] = _chain_accepts(match, steps)[cont].sum(), cont.sum()
    res = []
    for c in range(P):
        d = 1.0 + acc[c][idx].sum(1) / np.maximum(rows[c][idx].sum(1), 1.0)
        res.append((float(1.0 + acc[c].sum() / max(rows[c].sum(), 1.0)), _pct(d), acc[c], rows[c]))
    return res


def _pct(x: np.ndarray) -> tuple[float, float]:
    lo, hi = np.percentile(x, [2.5, 97.5])
    return float(lo), float(hi)


def identify_plan(draft: Eagle3Draft, reference: Sequence[LayerStates], head: TargetHead,
                  candidates: Optional[Sequence[Candidate]] = None, *, config_ids: Optional[Sequence[int]] = None,
                  steps: int = 3, rounds: int = 4, n_boot: int = 2000, seed: int = 0, batch: bool = True,
                  memo: Optional[dict] = None,
                  progress: Callable[[str], None] = lambda s: None) -> PlanIdentification:
    """Identify the plan the draft was trained on (module docstring): score every candidate, then the neighbourhood
    of the best until it is stable, and decide on the loss; the accept length of the best, the runner-up and the
    config's readings is measured too.

    Args:
        draft: the checkpoint loaded as SGLang serves it (:meth:`helpers.draft.model.Eagle3Draft.load`).
        reference: the target's own continuations with every layer (:func:`reference_from_dump`,
            :func:`reference_from_hf`); at least 2 sequences for a CI. Sampled continuations (temperature 1, as
            drafts are trained) separate neighbouring layers better than greedy ones, whose tokens the draft
            predicts from the token context alone.
        head: the target's final norm and lm_head (:meth:`TargetHead.load`), for its next-token distribution.
        candidates: the plans to try (default: :func:`candidate_plans` of ``config_ids``).
        config_ids: the draft config's ``eagle_aux_hidden_state_layer_ids`` (for the default candidates and to say
            which convention's reading of them is the identified plan).
        steps: chain length of the accept length (SGLang's ``--speculative-num-steps``).
        rounds: at most this many rounds of the best plan's neighbourhood (0: the candidates only).
        n_boot / seed: bootstrap resamples over sequences and their seed.
        batch: run the candidates of a sequence stacked in one draft-extend pass (:meth:`helpers.draft.model.
            Eagle3Draft.extend_many`; in groups of at most :data:`BATCH_LOGITS` logits), else one pass per candidate
            (the same figures, bit for bit on CPU float32: tests/unit/draft/test_plan_id.py; bench/bench_plan_id_batch.py
            times both).
        memo: a dict to keep each sequence's figures under each plan in, and to take them from: pass the same one
            to a later call with the same draft and target head whose reference holds the same
            :class:`LayerStates` objects and more (``investigate``'s second round on twice the continuations
            scores only the new ones; the figures are the same as without it).

    Returns:
        :class:`PlanIdentification`.

    Raises:
        BadInput: fewer than 2 sequences, no candidate whose tensors the reference holds and whose chunk count is the
            draft's (a candidate naming a tensor the reference lacks is left out), a reference without out(n-1).
    """
    t0 = time.perf_counter()
    if len(reference) < 2:
        raise BadInput(f"{len(reference)} reference sequence(s): expected >= 2 for a CI over sequences",
                       field="reference")
    names = set(reference[0].names)
    n_layers = sum(1 for t in names if t.startswith("out("))
    if out(n_layers - 1) not in names:
        raise BadInput(f"the every-layer reference has no {out(n_layers - 1)} (the target's last layer)",
                       field="layer_plan.tensors")
    if candidates is None:
        candidates = candidate_plans(config_ids, n_layers, draft.arch.num_aux)
    cands = [c for c in candidates if set(c.plan) <= names and len(c.plan) == draft.arch.num_aux]
    if not cands:
        raise BadInput("no candidate plan of the draft's aux chunk count names tensors the reference holds",
                       field="candidates")
    idx = np.random.default_rng(seed).integers(0, len(reference), size=(n_boot, len(reference)))
    with compute_threads(draft):
        views = _views(draft, reference, head, n_layers)
        progress(f"plan identification: {len(cands)} candidate plans x {len(reference)} sequences")
        scores = _score(draft, reference, views, cands, idx, batch, memo)
        seen = {s.plan for s in scores}
        done = 0
        for r_ in range(1, rounds + 1):
            best = min(scores, key=lambda s: s.loss)
            new = [Candidate(p, (f"{best.origins[0]}, then {move}",))
                   for p, move in neighbours(best.plan, n_layers) if p not in seen and set(p) <= names]
            if not new:
                break
            done = r_
            progress(f"plan identification round {r_}: {len(new)} plans around [{', '.join(best.plan)}]")
            scores += _score(draft, reference, views, new, idx, batch, memo)
            seen |= {c.plan for c in new}
            if min(scores, key=lambda s: s.loss).plan == best.plan:
                break
        scores.sort(key=lambda s: s.loss)
        readings = set()
        for conv, _w in _READINGS:
            try:
                readings.add(tuple(physical(i, conv, n_layers) for i in (config_ids or ())))
            except ValueError:
                pass
        chosen = [s for s in scores
                  if s is scores[0] or s is scores[min(1, len(scores) - 1)] or (config_ids and s.plan in readings)]
        for s, al in zip(chosen, _accept_lengths(draft, reference, views, [s.plan for s in chosen], steps, idx,
                                                 batch)):
            s.accept_length, s.accept_length_ci, s.accepted, s.al_rows = al
    best = scores[0]
    runner = scores[1] if len(scores) > 1 else None
    margin = margin_ci = al_m = al_ci = closest = closest_ci = None
    decision = "identified"
    if runner is not None:
        margin = runner.loss - best.loss
        margin_ci = _pct(runner.loss_draws(idx) - best.loss_draws(idx))
        al_m = best.accept_length - runner.accept_length
        al_ci = _pct(best.accepted[idx].sum(1) / np.maximum(best.al_rows[idx].sum(1), 1.0)
                     - runner.accepted[idx].sum(1) / np.maximum(runner.al_rows[idx].sum(1), 1.0))
        bd = best.loss_draws(idx)
        cis = [(s, _pct(s.loss_draws(idx) - bd)) for s in scores[1:]]
        closest, closest_ci = min(cis, key=lambda x: x[1][0])
        if closest_ci[0] <= 0:
            decision = "undecided"
    reading = None
    if config_ids and decision == "identified":
        for conv, word in _READINGS:
            try:
                if tuple(physical(i, conv, n_layers) for i in config_ids) == best.plan:
                    reading = f"the config's ids {list(config_ids)} read as {word}"
                    break
            except ValueError:
                continue
    return PlanIdentification(decision=decision, plan=best.plan if decision == "identified" else None, best=best,
                              runner_up=runner, margin=margin, margin_ci=margin_ci, al_margin=al_m,
                              al_margin_ci=al_ci, closest=closest, closest_ci=closest_ci, scores=scores, steps=steps,
                              sequences=len(reference), rows=int(best.rows.sum()), rounds=done,
                              seconds=time.perf_counter() - t0, config_reading=reading)


def write_plan_dump(reference: Sequence[LayerStates], ident: PlanIdentification, out_dir: str | Path, *,
                    name: str = "identified-plan") -> Path:
    """The stand-in for the withheld training data: the identified plan's tensors of the every-layer reference on the
    target's own continuations, as a project (e3f) training dump whose ``layer_plan`` records the plan and
    :data:`PROVENANCE` (``layer_plan.provenance``: ``identified``; :func:`helpers.diagnosis.static.
    resolve_training_plan` reports it so). The diagnosis then compares the served states against these.

    Raises:
        BadInput: ``ident`` is undecided (no plan to write: the caller stops short of naming wiring faults)."""
    if ident.decision != "identified" or ident.plan is None:
        raise BadInput(f"no identified layer plan to stand in for the training data ({ident.sentence()})",
                       field="--training")
    H = int(reference[0].states.shape[-1])
    samples = [{"key": r.key, "sample_id": r.key, "input_ids": r.tokens.tolist(), "num_prompt_tokens": r.start,
                "hidden": r.aux(ident.plan).float()} for r in reference]
    plan = {"tensors": list(ident.plan), "provenance": "identified", "note": PROVENANCE,
            "identification": {k: v for k, v in ident.to_json().items() if k != "scores"}}
    return write_dump(Path(out_dir) / name, samples, {"kind": "training", "source": {"type": "plan identification"},
                                                      "layer_plan": plan, "hidden_size": H})


__all__ = ["Candidate", "LayerStates", "PlanIdentification", "PlanScore", "PROVENANCE", "UNDECIDED_PROVENANCE",
           "candidate_plans", "identify_plan", "neighbours", "reference_from_dump", "reference_from_hf", "TargetHead",
           "write_plan_dump"]
