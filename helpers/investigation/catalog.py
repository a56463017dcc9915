"""The named checks: one declaration per check (:data:`CHECK_SPECS`). Light on purpose (no torch): a case file is
validated against it without importing the checks' implementations (:mod:`helpers.investigation.checks`).

A check ``NAME`` is implemented by ``helpers.investigation.checks.check_NAME`` (checked when that module is
imported); ``live`` says whether a live investigation runs it (declaration order = the live order: how the server
feeds the draft, then its settings). The finding kinds that say what a check asks are declared with the kinds
(:data:`helpers.kinds.CHECK_FINDINGS`). Check names are the ones case files (env/cases/*.yaml) and replay
documents use; some differ from the kind they ask about (``fc_bypass`` / ``fc_bypassed``, ``vocab_map`` /
``vocab_map_*``, ``embedding_included`` / ``embedding_in_place_of_layer``) and stay so those files keep working.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CheckSpec:
    """One named check: ``name`` (case files, replay steps), ``title`` and ``question`` (pages), ``live`` (run by
    ``helpers.investigation.live.investigate``)."""

    name: str
    title: str
    question: str
    live: bool = True


CHECK_SPECS: tuple[CheckSpec, ...] = (
    CheckSpec("tp_sharding", "TP sharding",
              "Are the captured states full width and identical on every TP rank, or H/tp shards?"),
    CheckSpec("embedding_all_reduce", "Embedding all-reduce",
              "Does VocabParallelEmbedding all-reduce, or does the draft get a per-rank partial embedding?"),
    CheckSpec("layer_offset", "Layer offset",
              "Is every chunk one (or k) layer(s) off from what the draft was trained on?"),
    CheckSpec("embedding_included", "Embedding in place of a layer",
              "Is the embedding fed where training used a layer output?"),
    CheckSpec("concat_order", "Concatenation order", "Are the aux chunks concatenated in the configured order?"),
    CheckSpec("rotated_basis", "Rotated basis",
              "Is a served chunk the trained tensor in another basis (same norms, other angles)?"),
    CheckSpec("norm_mismatch", "Missing or extra norm",
              "Is a served chunk the trained tensor with a normalisation applied or missing?"),
    CheckSpec("static_wiring", "Static wiring check",
              "From the configs alone, will the engine feed the tensors the draft was trained on?"),
    CheckSpec("fc_bypass", "fc bypassed", "Is an EAGLE-3 draft served with algorithm EAGLE (fc skipped)?"),
    CheckSpec("vocab_map", "Vocab map (d2t)", "Is the draft's pruned vocabulary mapped to target token ids?"),
    CheckSpec("num_steps_override", "num_steps / draft tokens override",
              "Did SGLang silently change the speculative settings?"),
    # the draft alone, offline: a live investigation computes it inside its acceptance budget (draft stage)
    CheckSpec("draft_standalone", "Standalone draft test",
              "Run alone, outside the server, does the draft do what its training log says?", live=False),
    # needs a target-only baseline server: never run by a live investigation
    CheckSpec("verify_bottleneck", "Verify time is the bottleneck",
              "Once acceptance is right, does verify time bound tok/s?", live=False),
)

#: name -> (title, question)
CATALOG: dict[str, tuple[str, str]] = {s.name: (s.title, s.question) for s in CHECK_SPECS}
#: the checks a live investigation runs, in order
LIVE_CHECKS: tuple[str, ...] = tuple(s.name for s in CHECK_SPECS if s.live)
