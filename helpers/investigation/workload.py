"""The ``requests_accept_less`` finding: the user's requests (``--requests FILE``, parsed and described by
:mod:`helpers.acceptance.workload`) and the bundled training-like prompts measured on the same server, the loss of
accept length between them with an unpaired CI, its decision by :func:`helpers.draft.decide.decide`, and the observed
differences between the two sets (chat template, temperature, prompt length, max tokens, language), which are named
as observed, not as proven causes.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from ..acceptance.measure import measure
from ..acceptance.prompts import load_prompts
from ..acceptance.workload import (WorkloadRequest, describe, differences, fit_context, generation_defaults,
                                   load_requests, load_tokenizer, require_vocab, resolve_tokenizer, training_is_chat,
                                   training_like_prompts, unpaired_loss, vocab_size_of)
from ..formats.training_data import TrainingData
from ..errors import printable
from ..records import Finding
from ..diagnosis.detectors.base import finding
from ..draft.decide import decide, threshold
from ..engines.detect import adapter as engine_adapter


def workload_decision(loss: Mapping[str, Any]) -> dict:
    """:func:`helpers.draft.decide.decide` on :func:`unpaired_loss`'s loss, the material threshold from the
    training-like prompts' accept length (:func:`helpers.draft.decide.threshold`), ``n`` the smaller set (below
    :data:`helpers.draft.decide.SMALL_N` no loss is cleared). Returns ``decide``'s dict."""
    return decide(loss.get("delta"), *(loss.get("ci") or [None, None]), threshold(loss.get("ref_accept_length")),
                  n=min(loss.get("n_ref") or 0, loss.get("n_user") or 0) or None, unit="requests")


def workload_finding(loss: Mapping[str, Any], decision: Mapping[str, Any], diffs: Sequence[str],
                     *, user: Mapping[str, Any], ref: Mapping[str, Any],
                     verify_fault: Optional[Mapping[str, Any]] = None) -> Optional[Any]:
    """The ``requests_accept_less`` finding (:func:`helpers.diagnosis.detectors.finding`) when the decision is
    ``counts`` (the user's requests accept materially less, beyond the CI) or ``undecided`` (its severity then says
    so: the CI neither rules a material loss in nor out); None when ``clear``. ``verify_fault``: the engine adapter's
    ``verify_sampling_fault`` when some of the user's requests sample (temperature > 0): the server verifies those with
    other sampling values than theirs, so the detail says the temperature's share is not the workload's alone (kept
    as ``evidence.verify_sampling``)."""
    dec = decision["decision"]
    if dec == "clear":
        return None
    lo, hi = decision["ci"]
    what = "; ".join(diffs) if diffs else "no difference in template, temperature, length or max tokens was seen"
    head = (f"the user's requests accept {loss['user_accept_length']:.2f} tokens per verify step against "
            f"{loss['ref_accept_length']:.2f} for the bundled training-like prompts on the same server: a loss of "
            f"{loss['delta']:.2f} [{lo:.2f}, {hi:.2f}] ({dec}; material >= {decision['threshold']:.2f}; "
            f"{loss['n_user']} vs {loss['n_ref']} requests, {loss['interval']})")
    detail = f"{head}. Observed differences (not proven causes): {what}"
    extra = {}
    if verify_fault is not None:
        detail += ("; on this server sampled requests are verified with other per-token sampling values than the "
                   "request's (verify_sampling_params_wrong), so a loss at temperature > 0 is the engine's as well as "
                   "the requests'")
        extra["verify_sampling"] = dict(verify_fault.get("evidence") or {})
    return finding("requests_accept_less", None, detail, decision=dec, loss=dict(loss), **extra,
                   threshold=decision["threshold"], ci=[lo, hi],
                   differences=list(diffs), user=dict(user), training_like=dict(ref),
                   settle=decision.get("settle"),
                   source="live: /generate meta_info (completion_tokens / spec_verify_ct) of both request sets")


#: the fewest training-like prompts measured against the user's requests (the decision clears nothing below
#: helpers.draft.decide.SMALL_N), and the most (the bundled set's size)
MIN_REFERENCE, MAX_REFERENCE = 10, 48


@dataclasses.dataclass
class WorkloadComparison:
    """What :func:`compare_workload` measured: the two measurements (:class:`helpers.acceptance.measure.
    AcceptanceResult`), the loss, its decision, the observed differences and the finding (None when cleared)."""

    user: Any
    reference: Any
    loss: dict
    decision: dict
    differences: list
    finding: Optional[dict]
    reference_chat: bool

    def doc(self) -> dict:
        """The comparison as a JSON-able dict (``workload.json`` of the run folder)."""
        return {"loss": self.loss, "decision": self.decision, "differences": self.differences,
                "finding": self.finding, "reference_chat_template": self.reference_chat,
                "user": self.user.summary.get("workload"), "training_like": self.reference.summary.get("workload"),
                "user_summary": {k: self.user.summary.get(k) for k in ("accept_length", "accept_length_lo",
                                                                       "accept_length_hi", "n_requests")},
                "training_like_summary": {k: self.reference.summary.get(k) for k in (
                    "accept_length", "accept_length_lo", "accept_length_hi", "n_requests")},
                "provenance": self.user.summary.get("provenance")}


def compare_workload(client: Any, requests: Sequence[WorkloadRequest], *, max_new_tokens: int = 128,
                     tokenizer: Any = None, reference_chat: bool = False, n_reference: Optional[int] = None,
                     n_boot: int = 2000, seed: int = 0, warmup: int = 1, progress: bool = True,
                     command: Optional[Sequence[str] | str] = None) -> WorkloadComparison:
    """The user's requests and the bundled training-like prompts measured on the same server
    (:func:`helpers.acceptance.measure.measure`, cache flushed before each set), the unpaired loss
    (:func:`unpaired_loss`), its decision (:func:`workload_decision`), the observed differences
    (:func:`differences`) and the finding (:func:`workload_finding`).

    The training-like prompts: :func:`training_like_prompts`, ``n_reference`` of them (default: as many as the user's
    requests, from :data:`MIN_REFERENCE` to :data:`MAX_REFERENCE`), greedy (temperature 0, the text the draft was
    trained to predict), as many new tokens each as the median of the requests' own max tokens (``max_new_tokens`` for
    a request that sets none), through the chat template when ``reference_chat``.

    Raises: what :func:`helpers.acceptance.measure.measure` raises (the server unreachable, every request failed)."""
    n = n_reference or min(MAX_REFERENCE, max(MIN_REFERENCE, len(requests)))
    ref_prompts = training_like_prompts(n, tokenizer=tokenizer, chat=reference_chat)
    # like with like: the training-like prompts generate as long as the user's requests do (their median max tokens),
    # so measure and investigate compare the same thing whatever their own --max-new-tokens default
    asked = [int(q.sampling.get("max_new_tokens") or max_new_tokens) for q in requests]
    max_new_tokens = int(np.median(asked)) if asked else int(max_new_tokens)
    info = client.server_info()
    eng = engine_adapter(str(info.get("engine") or "sglang"))
    ck = eng.draft_checksum
    sampled = any(float(q.sampling.get("temperature") or 0.0) > 0 for q in requests)
    verify_fault = eng.verify_sampling_fault(info) if sampled else None
    user = measure(client, requests=list(requests), max_new_tokens=max_new_tokens, warmup=warmup, n_boot=n_boot,
                   seed=seed, progress=progress, label="requests", command=command, draft_checksum=ck)
    ref = measure(client, ref_prompts, max_new_tokens=max_new_tokens, warmup=0, n_boot=n_boot, seed=seed,
                  progress=progress, label="training-like", temperature=0.0, command=command, draft_checksum=ck)
    texts = {p.id: p.text for p in load_prompts(None, n=n)}
    ref_reqs = [WorkloadRequest(prompt=p, sampling={"temperature": 0.0, "max_new_tokens": int(max_new_tokens)},
                                kind="training-like", line=0, chat_template=reference_chat, content=texts.get(p.id))
                for p in ref_prompts]
    du, dr = describe(requests, user.per_request), describe(ref_reqs, ref.per_request)
    ref.summary["workload"] = dr
    loss = unpaired_loss(ref.per_request, user.per_request, n_boot=n_boot, seed=seed)
    dec = workload_decision(loss)
    diffs = differences(du, dr)
    return WorkloadComparison(user=user, reference=ref, loss=loss, decision=dec, differences=diffs,
                              finding=workload_finding(loss, dec, diffs, user=du, ref=dr, verify_fault=verify_fault),
                              reference_chat=reference_chat)


def comparison_text(c: WorkloadComparison) -> str:
    """One paragraph for the terminal: both accept lengths, the loss with its CI and decision, the differences."""
    L, d = c.loss, c.decision
    if not np.isfinite(L.get("delta", float("nan"))):
        return "workload: no accept length on one of the two request sets (no spec fields): not compared"
    lo, hi = d["ci"]
    line = (f"workload: your requests {L['user_accept_length']:.2f} vs training-like prompts "
            f"{L['ref_accept_length']:.2f} tokens per verify step; loss {L['delta']:+.2f} [{lo:+.2f}, {hi:+.2f}] "
            f"({L['interval']}): {d['decision']} (material >= {d['threshold']:.2f})")
    if c.differences:
        line += "\nobserved differences (not proven causes): " + "; ".join(c.differences)
    if d["decision"] == "undecided" and (d.get("settle") or {}).get("text"):
        line += f"\nto settle: {d['settle']['text']}"
    return line


@dataclasses.dataclass
class WorkloadInput:
    """The requests file as :func:`workload_check` read it: the tokenizer folder and where it came from, the
    tokenizer (None when none is readable), the target's vocab size (None: unknown) and the requests."""

    tok_dir: Any
    note: str
    tokenizer: Any
    vocab_size: Optional[int]
    requests: list


def workload_check(r: Any) -> None:
    """Read and check the whole requests file (``--requests``) right after attach, before any other request: chat
    bodies rendered with the tokenizer the workload stage uses (``--tokenizer``, else the server's
    ``tokenizer_path`` / ``model_path`` when readable, else the target folder: :func:`resolve_tokenizer`), token ids
    below the target's vocab size (its ``config.json``, else the tokenizer's length), every sampling param checked
    (:func:`helpers.acceptance.workload.load_requests`). Sets ``r.workload``; nothing when there is no
    ``--requests`` or with ``--no-measure``.

    Every request is checked against the server's context as its engine checks it
    (:meth:`helpers.engines.base.EngineAdapter.context_rule`, :func:`helpers.acceptance.workload.fit_context`).

    Raises: BadInput (exit 2) naming the file, the line and the field."""
    req = r.req
    requests_file, tokenizer_dir = req.requests
    if requests_file is None or not req.live_measure:
        return
    tok_dir, note = resolve_tokenizer(r.att.info, tokenizer_dir)
    if tok_dir is None and r.att.target_dir is not None:
        tok_dir, note = r.att.target_dir, f"tokenizer from the target folder {r.att.target_dir}"
    tok = load_tokenizer(tok_dir) if tok_dir is not None else None
    vocab = vocab_size_of(r.att.target_dir) or vocab_size_of(tok_dir, tok)
    reqs = load_requests(requests_file, tokenizer=tok, default_max_new_tokens=req.max_new_tokens,
                         gen_defaults=generation_defaults(r.att.target_dir), vocab_size=vocab)
    require_vocab(reqs, vocab, note, requests_file)
    rule = r.adapter.context_rule(r.client)        # past the context: refused here as the engine would, or cut
    if rule is not None:
        r.doc.notes.extend(printable(n) for n in fit_context(reqs, rule, requests_file, tokenizer=tok))
    r.workload = WorkloadInput(tok_dir=tok_dir, note=note, tokenizer=tok, vocab_size=vocab, requests=reqs)


def workload_stage(r: Any) -> None:
    """The user's requests (``--requests FILE``) replayed with their own sampling params against the bundled
    training-like prompts on the same server (:func:`compare_workload`; the bundled
    prompts through the target tokenizer's chat template when it has one and the training data was chat-formatted):
    ``doc.workload``, both measurements under ``acceptance/requests`` and ``acceptance/training-like``, and the
    ``requests_accept_less`` finding unless the loss is cleared. ``r``: :class:`helpers.investigation.live.Run` after
    its engine-state stage. The budget's live stage keeps the bundled greedy prompts: its offline pairing runs the
    draft on the greedy continuation's served states."""
    req, doc = r.req, r.doc
    requests_file = req.requests[0]
    if requests_file is None:
        return
    if not req.live_measure:
        doc.notes.append("--requests not replayed: --no-measure (no live requests)")
        return
    t = r.step("workload")
    if getattr(r, "workload", None) is None:       # read at attach (workload_check); again only if it was not
        workload_check(r)
    w = r.workload
    tok, note, reqs = w.tokenizer, w.note, w.requests
    chat = bool(tok is not None and training_is_chat(tok, list(TrainingData(
        req.training, hidden_size=r.tcfg.hidden_size, max_samples=8))))
    cmp = compare_workload(r.client, reqs, max_new_tokens=req.max_new_tokens, tokenizer=tok, reference_chat=chat,
                           progress=False)
    cmp.user.save(req.run_dir / "acceptance" / "requests")
    cmp.reference.save(req.run_dir / "acceptance" / "training-like")
    doc.workload = {**cmp.doc(), "tokenizer": note, "requests_file": str(requests_file)}
    ignored = sorted({k for q in reqs for k in q.ignored})
    if ignored:
        doc.notes.append(printable(f"--requests: not sent (the answers may differ from production): "
                                   f"{', '.join(ignored)}"))
    if cmp.finding is not None and cmp.finding["kind"] not in {f.kind for f in doc.findings}:
        doc.findings.append(Finding(**cmp.finding))
    doc.notes.append(comparison_text(cmp).replace("\n", "; "))    # the sentence tells the budget; this, the requests
    r.done("workload", t, comparison_text(cmp).splitlines()[0])
