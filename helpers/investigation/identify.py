"""``investigate`` without training data: the layer plan the draft was trained on, identified from the draft itself
(:mod:`helpers.draft.plan_id`) on the server's own continuations, stands in for the training data."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Optional, Sequence

from ..acceptance.prompts import load_prompts
from ..capture import capture_reference_hf
from ..draft.model import Eagle3Draft
from ..draft.plan_id import PROVENANCE, TargetHead, identify_plan, reference_from_dump, write_plan_dump
from ..engines.base import EngineAdapter
from ..errors import BadInput
from ..formats.configs import read_draft_config
from ..runfiles import write_json
from ..server.client import ServerClient
from .attach import Attachment, hf_reference_fits

#: prompts, tokens and sampling of the target's own continuations the layer plan is identified on (no training data):
#: sampled at temperature 1 as drafts are trained (greedy text is predictable from the tokens alone and leaves
#: neighbouring layers undecided on few prompts; tests/unit/draft/test_plan_id.py); seeded, one seed per prompt, so a
#: rerun sees the same continuations where the engine honours the seed (vLLM; SGLang 0.5.23 only with
#: --enable-deterministic-inference, sglang/srt/sampling/sampling_batch_info.py::SamplingBatchInfo.from_schedule_batch:
#: without it the embedded server draws each answer's sampled tokens anew on every run)
IDENTIFY_PROMPTS, IDENTIFY_TOKENS = 16, 96
IDENTIFY_SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "sampling_seed": 0}
#: requests in flight while the server writes those continuations: a round's prompts all at once (one at a time took
#: 43-55 s of the step's 61.7 s on the embedded TP 2 server; 8 in flight 14-17 s, 16 in flight 10-11 s with the
#: every-layer reference, the same greedy tokens: bench/bench_plan_id_concurrent.py, bench/RESULTS.md)
IDENTIFY_CONCURRENCY = IDENTIFY_PROMPTS


def identify_stage(r: Any) -> None:
    """No ``--training``: the layer plan the draft was trained on, identified from the checkpoint
    (:func:`helpers.draft.plan_id.identify_plan`) on the server's own sampled continuations of
    :data:`IDENTIFY_PROMPTS` prompts and their every-layer reference (the server's own capture, else HF: the
    reference stage's choice, :func:`every_layer_reference`), for the run ``r``
    (:class:`helpers.investigation.live.Run` after attach; nothing when it has training data). Identified: the plan's
    reference states stand in for the training data (:func:`helpers.draft.plan_id.write_plan_dump`) and every output
    says so. Undecided (also on twice the prompts): BadInput naming ``--training`` (no wiring fault is named on a
    guessed plan). Either way ``run_dir/plan_identification.json`` records it (``rounds`` of continuations, the last
    pass's ``search_rounds``, the step's wall ``seconds`` and its ``offline_seconds``) and ``r.timings`` the step."""
    req, att, doc = r.req, r.att, r.doc
    if req.training is not None:
        return
    t = r.step("plan identification")
    try:
        draft = Eagle3Draft.load(att.draft_dir, att.target_dir)
        ids, head = read_draft_config(att.draft_dir).nested_layer_ids, TargetHead.load(att.target_dir)
        refs: list = []
        memo: dict = {}                    # the first prompts' figures, kept for the second round
        offline = 0.0
        for k in range(2):                 # undecided on the first prompts: measured again on twice as many, once
            more, how, served = _continuations(r, k * IDENTIFY_PROMPTS, IDENTIFY_PROMPTS, f"identify-{k}")
            refs = refs + more
            ident = identify_plan(draft, refs, head, config_ids=ids, progress=r.progress, memo=memo)
            offline += ident.seconds
            if ident.decision == "identified":
                break
            r.progress(f"plan identification undecided on {len(refs)} continuations: {ident.sentence()}")
        # rounds: of continuations (the second on twice the prompts); search_rounds: the last pass's neighbourhood
        # rounds; seconds: the step's wall time (requests, every-layer reference, offline passes); offline_seconds:
        # the offline passes alone
        write_json(req.run_dir / "plan_identification.json", {
            **ident.to_json(), "rounds": k + 1, "seconds": round(time.monotonic() - t, 2),
            "offline_seconds": round(offline, 2), "reference": how, "continuations": served})
        if ident.decision != "identified":
            raise BadInput(f"--training not given and the layer plan the draft was trained on is undecided: "
                           f"{ident.sentence()}; pass --training (its data settle it)", field="--training")
        req.training = write_plan_dump(refs, ident, req.run_dir / "dumps")
    finally:                               # the step's time is recorded however it ends (undecided included)
        r.timings["plan identification"] = round(time.monotonic() - t, 2)
    doc.training = f"{req.training} ({PROVENANCE})"
    doc.notes.append(ident.sentence())
    r.done("plan identification", t, ident.sentence())


def _continuations(r: Any, first: int, n: int, name: str) -> tuple[list, str, str]:
    """The server's own sampled continuations of bundled prompts ``first .. first + n - 1`` (token ids only,
    :data:`IDENTIFY_CONCURRENCY` requests in flight: :meth:`helpers.engines.base.EngineAdapter.continuations`) and
    their every-layer reference: ``(LayerStates list, how the reference was made, the continuations' file
    run_dir/dumps/<name>-continuations.json)``.

    Raises:
        BadInput: no every-layer reference can be made (what is missing named)."""
    dumps = r.req.run_dir / "dumps"
    ps = load_prompts(None, n=first + n)[first:]
    sampling = {**IDENTIFY_SAMPLING, "sampling_seed": IDENTIFY_SAMPLING["sampling_seed"] + first}
    conts = r.adapter.continuations(r.client, ps, max_new_tokens=IDENTIFY_TOKENS, sampling=sampling,
                                    concurrency=IDENTIFY_CONCURRENCY, timeout_s=float(r.client.generate_timeout))
    served = dumps / f"{name}-continuations.json"
    write_json(served, {"sampling": sampling, "max_new_tokens": IDENTIFY_TOKENS, "concurrency": IDENTIFY_CONCURRENCY,
                        "continuations": [{"id": c.id, "prompt_ids": list(c.prompt_ids),
                                           "output_ids": list(c.output_ids)} for c in conts]})
    toks = [{"id": c.id, "input_ids": c.tokens} for c in conts]
    ref, how, missing = every_layer_reference(r.adapter, r.att, r.client, toks, r.req.run_dir,
                                              r.tcfg.num_hidden_layers, name=f"{name}-reference")
    if ref is None:
        raise BadInput(f"--training not given and the layer plan cannot be identified without an every-layer "
                       f"reference ({missing})", field="--training")
    return reference_from_dump(ref, starts={c.id: len(c.prompt_ids) for c in conts}), how, str(served)


def every_layer_reference(adapter: EngineAdapter, att: Attachment, client: ServerClient, samples: Sequence[Any],
                          run_dir: Path, num_layers: int, *, name: str = "reference"
                          ) -> tuple[Optional[Path], str, Optional[str]]:
    """(reference dump, how it was made, what is missing when there is none): the server's own every-layer capture
    when its engine adapter can record one, else HF on the target folder when it fits, else none. The dump is
    ``run_dir/dumps/<name>-server`` or ``<name>-hf``."""
    own = adapter.every_layer_source(client, att.layers_dir)
    if own is not None:
        path = adapter.capture_every_layer(client, samples, run_dir / "dumps", name=f"{name}-server",
                                           num_layers=num_layers, hooks_layers_dir=att.layers_dir)
        return path, own, None
    fits, why = hf_reference_fits(att.target_dir)
    if fits:
        path = capture_reference_hf(att.target_dir, samples, run_dir / "dumps", name=f"{name}-hf", progress=False)
        return path, f"HF transformers on {att.target_dir} ({why})", None
    return None, "none", (f"no every-layer reference: the server records no every layer itself and HF cannot load "
                          f"the target here ({why}). Without one, which layer each chunk holds cannot be measured (a "
                          "layer offset looks like a rotated basis or a wrong layer); restart the server with "
                          "`python -m helpers server start --capture-layers DIR` (embedded SGLang), "
                          "env/gpu/launch_tp8.sh with LAYERS_DIR (GPU SGLang), or the tool's worker extension "
                          "(vLLM: `python -m helpers server start --engine vllm`) to settle it")
