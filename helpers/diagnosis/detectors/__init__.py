"""Named wiring faults: one function per finding kind, each returning findings with evidence.

A finding is ``{"kind": str, "chunk": int|None, "detail": str, "evidence": {...}}`` (DESIGN.md "Findings");
``kind`` is declared in :mod:`helpers.kinds` (the contract with helpers/hooks.py fault injection). ``chunk`` is
the served chunk index (None for findings about the whole width, the config, or training data).

Modules, by what the detectors look at:

* :mod:`.config` -- static (no tensors): configs, SGLang's rules and the two capture plans;
* :mod:`.context` -- :class:`Context` (a :class:`helpers.diagnosis.compare.Comparison` plus plans and configs),
  its :class:`Claims` and the settled :class:`Correspondence`;
* :mod:`.served` -- what the server delivers whatever the tensor (non-finite, tokens, TP, width, zeros);
* :mod:`.transforms` -- a training chunk through a rotation, a norm, a constant, or partly altered;
* :mod:`.layout` -- which tensor sits in which chunk (offset, embedding, order, extra / missing, wrong layer);
* here: the order they run in (:data:`NUMERIC_DETECTORS`) and :func:`run_numeric`.
"""
from __future__ import annotations

from ...kinds import ALIGNED_KINDS, FINDING_KINDS, LAYOUT_KINDS  # noqa: F401  (re-exported)
from .base import finding  # noqa: F401  (re-exported)
from .config import (  # noqa: F401  (re-exported)
    detect_config_ids_ignored,
    detect_fc_bypassed,
    detect_num_draft_tokens_overridden,
    detect_unsupported_draft,
    detect_vocab_map_missing,
    static_layer_findings,
)
from .context import IDENTITY_SOURCES, Claim, Claims, Context, Correspondence  # noqa: F401  (re-exported)
from .layout import (
    detect_chunk_order,
    detect_embedding_in_place_of_layer,
    detect_extra_chunk,
    detect_layer_offset,
    detect_missing_chunk,
    detect_wrong_layer,
)
from .served import (  # noqa: F401  (_vocab_shard re-exported for tests/support)
    _vocab_shard,
    detect_embedding_not_all_reduced,
    detect_nan_or_inf,
    detect_not_comparable,
    detect_token_mismatch,
    detect_tp_partial_sum,
    detect_tp_sharded_width,
    detect_width_mismatch,
    detect_zero_chunk,
)
from .transforms import (  # noqa: F401  (re-exported)
    PARTIAL_MAX_DIMS,
    PARTIAL_SHARE,
    detect_norm_mismatch,
    detect_partial_match,
    detect_rotated_basis,
    detect_scaled_chunk,
)

# The order is the meaning: a detector skips every chunk an earlier one claimed (Claims.claimed), so the most
# specific explanation of a chunk must come first.
#: Served-side facts, before the correspondence is settled. embedding_not_all_reduced before tp_partial_sum (a
#: rank-local embedding is also a rank disagreement: it is claimed as the embedding); not_comparable and zero_chunk
#: claim chunks that no row comparison can name, so that no layer detector names them.
SERVED_DETECTORS = (
    detect_nan_or_inf, detect_token_mismatch, detect_tp_sharded_width, detect_embedding_not_all_reduced,
    detect_tp_partial_sum, detect_width_mismatch, detect_not_comparable, detect_zero_chunk,
)
#: After the correspondence is settled from the served-side claims (Context.settle). The embedding (context-free
#: rows identify it directly) before the transform fits; a chunk a transform explains (rotation, then norm, then
#: one constant) is not "partially equal" (partial_match after them); a consistent layer offset is one finding,
#: not a permutation (layer_offset before chunk_order, which stands down when the offset applies); what is left
#: unexplained last: extra_chunk, then wrong_layer / unidentified_chunk, then missing_chunk (a training chunk no
#: served chunk stands for, after every claim that says which training chunk a served chunk stands for).
LAYOUT_DETECTORS = (
    detect_embedding_in_place_of_layer, detect_rotated_basis, detect_norm_mismatch, detect_scaled_chunk,
    detect_partial_match, detect_layer_offset, detect_chunk_order, detect_extra_chunk, detect_wrong_layer,
    detect_missing_chunk,
)
NUMERIC_DETECTORS = SERVED_DETECTORS + LAYOUT_DETECTORS
#: the detectors that still run when the draft's fc is bypassed (the served width says nothing about layers)
ALWAYS = (detect_nan_or_inf, detect_token_mismatch)


def _withhold_unaligned(ctx: Context, out: list[dict]) -> list[dict]:
    """Kinds marked ``aligned`` in :mod:`helpers.kinds` are built on the served rows compared with the training
    rows of the same tokens (served-side facts: non-finite or zero rows, context-free rows, widths, do not depend
    on the alignment). When served samples differ from their training samples inside the prompt, the file's rows are not known
    to be aligned with the training rows (samples reordered, another data set, rows of one sample under another
    sample's ids): findings built on the row comparison are withheld and listed in the token_mismatch finding,
    which says what would settle them."""
    tm = next((f for f in out if f["kind"] == "token_mismatch" and "mismatches" in f["evidence"]), None)
    if tm is None:
        return out
    held = [f for f in out if f["kind"] in ALIGNED_KINDS]
    if not held:
        return out
    tm["evidence"]["withheld_findings"] = [{"kind": f["kind"], "chunk": f["chunk"], "detail": f["detail"]}
                                           for f in held]
    what = ", ".join(f"{f['kind']}" + ("" if f["chunk"] is None else f" (chunk {f['chunk']})") for f in held)
    tm["detail"] += (f". The rows of the other samples do not match training either ({what}), but with prompts "
                     "that differ elsewhere in this file their rows are not known to be aligned: those findings are "
                     "withheld (evidence.withheld_findings). Capture the served states for the training prompts "
                     "(the same token ids, in the same samples) to settle which tensor each chunk holds")
    return [f for f in out if f["kind"] not in ALIGNED_KINDS]


def run_numeric(ctx: Context) -> list[dict]:
    """All numeric detectors in :data:`NUMERIC_DETECTORS` order: :data:`SERVED_DETECTORS`, then the chunk
    correspondence is settled from their claims (:meth:`Context.settle`), then :data:`LAYOUT_DETECTORS`. A numeric
    fc_bypassed short-circuits everything but :data:`ALWAYS`. Findings built on the row comparison are withheld
    when the served prompts differ from training (:func:`_withhold_unaligned`)."""
    out: list[dict] = []
    numeric_fc = detect_fc_bypassed(ctx.draft, ctx.server, ctx, ctx.weights)
    for stage in (SERVED_DETECTORS, LAYOUT_DETECTORS):
        if stage is LAYOUT_DETECTORS:
            ctx.settle()
        for det in stage:
            if numeric_fc and det not in ALWAYS:
                continue
            out.extend(det(ctx))
    return _withhold_unaligned(ctx, out) + numeric_fc
