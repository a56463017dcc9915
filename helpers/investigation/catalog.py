"""The catalogue of named checks: name -> (title, question). Light on purpose (no torch): a case file is validated
against it without importing the checks' implementations (:mod:`helpers.investigation.checks`)."""
from __future__ import annotations

CATALOG: dict[str, tuple[str, str]] = {
    "embedding_all_reduce": ("Embedding all-reduce",
                             "Does VocabParallelEmbedding all-reduce, or does the draft get a per-rank partial embedding?"),
    "concat_order": ("Concatenation order", "Are the aux chunks concatenated in the configured order?"),
    "tp_sharding": ("TP sharding", "Are the captured states full width and identical on every TP rank, or H/tp shards?"),
    "layer_offset": ("Layer offset", "Is every chunk one (or k) layer(s) off from what the draft was trained on?"),
    "embedding_included": ("Embedding in place of a layer", "Is the embedding fed where training used a layer output?"),
    "num_steps_override": ("num_steps / draft tokens override", "Did SGLang silently change the speculative settings?"),
    "fc_bypass": ("fc bypassed", "Is an EAGLE-3 draft served with algorithm EAGLE (fc skipped)?"),
    "verify_bottleneck": ("Verify time is the bottleneck", "Once acceptance is right, does verify time bound tok/s?"),
    "static_wiring": ("Static wiring check",
                      "From the configs alone, will the engine feed the tensors the draft was trained on?"),
    "vocab_map": ("Vocab map (d2t)", "Is the draft's pruned vocabulary mapped to target token ids?"),
    "rotated_basis": ("Rotated basis", "Is a served chunk the trained tensor in another basis (same norms, other "
                                       "angles)?"),
    "norm_mismatch": ("Missing or extra norm", "Is a served chunk the trained tensor with a normalisation applied or "
                                               "missing?"),
}
