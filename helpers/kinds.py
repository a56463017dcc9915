"""The finding kinds: one declaration per kind (DESIGN.md "Findings"), low in the import graph (stdlib only).

Every property of a kind lives in its :class:`Kind` entry of :data:`KINDS`, and every kind table the detectors,
the static check, the diagnosis, the proposed fix, the acceptance budget and the live investigation use is derived
from it (:data:`FINDING_KINDS`, :data:`LAYOUT_KINDS`, :data:`ALIGNED_KINDS`, :data:`TENSOR_KINDS`,
:data:`DRAFT_KINDS`, :data:`ACCEPTANCE_KINDS`, :data:`ID_KINDS`, :data:`PLAN_KINDS`, :data:`ENGINE_FIXES`,
:data:`KIND_TEXT`, :data:`CHECK_FINDINGS`, :func:`report_rank`). A new kind is one entry here plus its detector;
:class:`helpers.records.Finding` and :func:`helpers.diagnosis.detectors.finding` refuse a name not declared here.
(``helpers.draft.checks.KIND_ORDER``, the draft checkpoint report's own order, is not derived from it.)

The declaration order is the report order (:func:`report_rank`): why the server cannot serve first, then the
config and draft-checkpoint faults, then the measured tensors from the most specific explanation to the least
(``wrong_layer``, ``extra_chunk``, ``missing_chunk`` last), then the acceptance budget.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

#: ``setup``: what the tensors are measured against (configs, SGLang's rules, the server, the tokens);
#: ``tensor``: the tensors the draft receives (measured); ``draft``: the draft checkpoint itself
#: (helpers/draft/checks.py); ``acceptance``: the acceptance budget (helpers/draft/budget.py) and the ablations and
#: workload sweeps that join it (helpers/investigation/ablate.py).
Group = Literal["setup", "tensor", "draft", "acceptance"]
#: the fix a kind implies (helpers.investigation.propose): ``config_ids`` (draft config layer ids under the engine's
#: rules), ``flag`` (a server flag or draft config flag), ``vocab_map`` (d2t / t2d tensors), ``drop_tensors`` (draft
#: tensors the engine's loader must not see: the finding's ``evidence.tensors_to_drop``), ``engine`` (a change
#: in the capture path, in the words of ``engine_fix``), ``detail`` (no config fixes it; the finding's detail is
#: the engine part), None (nothing to propose).
Fix = Literal["config_ids", "flag", "vocab_map", "engine", "detail", "drop_tensors"]


@dataclass(frozen=True)
class Kind:
    """One finding kind.

    Attributes:
        name: the ``kind`` field of a finding (on disk in investigation.json and diagnosis JSON).
        group: see :data:`Group`.
        text: the postmortem sentence's words for it (``helpers.investigation.live.sentence``).
        layout: it says which tensor sits in which chunk (the served layout); a config-ids fix can address it.
        aligned: built on the served rows compared with the training rows of the same tokens: withheld when the
            served prompts differ from training (``helpers.diagnosis.detectors.run_numeric``).
        fix: see :data:`Fix`.
        engine_fix: the engine change in words (``fix == "engine"``).
        checks: the named checks (helpers.investigation.catalog) that ask what this kind says; such a check
            refuted while the finding stands in the same run is reported inconclusive.
        changes_plan: it is about which tensor the draft receives, so a fix for it changes the served plan (the
            acceptance budget proves such a fix offline: ``helpers.investigation.acceptance.fix_plan``).
        stage: the acceptance budget's stage where what it says costs accepted tokens (``draft``: the checkpoint as
            served against its training log; ``wiring``: the aux states fed; ``engine``: after the capture point;
            ``settings``: the speculative settings; ``workload``: the requests), or None when it has no acceptance
            effect of its own to measure. A finding with a stage carries that stage's loss as evidence and a fix
            for it that recovers acceptance is a loss of that stage (``helpers.investigation.story``).
    """

    name: str
    group: Group
    text: str
    layout: bool = False
    aligned: bool = False
    fix: Optional[Fix] = None
    engine_fix: Optional[str] = None
    checks: tuple[str, ...] = ()
    changes_plan: bool = False
    stage: Optional[Stage] = None


#: the stages of the acceptance budget (helpers/draft/budget.py) a kind can cost acceptance at
Stage = Literal["draft", "wiring", "engine", "settings", "workload"]
#: by group, the stage a kind costs acceptance at unless its entry says otherwise
_GROUP_STAGE = {"tensor": "wiring", "draft": "draft"}
#: kinds with no acceptance effect of their own, or one the budget cannot measure as a stage loss (``_k(...,
#: stage=NO_STAGE)``)
NO_STAGE = "-"


def _k(*args, **kw) -> Kind:
    k = Kind(*args, **kw)
    stage = k.stage if k.stage is not None else _GROUP_STAGE.get(k.group)
    return Kind(**{**k.__dict__, "stage": None if stage == NO_STAGE else stage})


#: every finding kind, in report order
KINDS: tuple[Kind, ...] = (
    # -- why the server cannot serve ---------------------------------------------------------------------------
    _k("unsupported_target", "setup", "SGLang cannot capture aux states for this target", fix="engine",
       engine_fix="serve a target architecture whose SGLang model class captures aux hidden states "
                  "(set_eagle3_layers_to_capture), or use an engine that supports it"),
    _k("unsupported_draft", "setup", "SGLang cannot serve this draft as EAGLE-3", fix="engine",
       engine_fix="serve the draft with an EAGLE-3 draft class SGLang registers (LlamaForCausalLMEagle3 ...)"),
    _k("mtp_head_refused", "setup", "the engine refuses the MTP / NextN head as configured", fix="detail"),
    _k("server_fatal", "setup", "the server fails with these layer ids (at start-up or at the first forward)",
       fix="detail"),
    # -- the config and the server's settings ------------------------------------------------------------------
    _k("config_ids_ignored", "setup", "SGLang ignores the draft config's layer ids", fix="config_ids",
       changes_plan=True, stage="wiring"),
    _k("config_ids_mismatch", "setup", "the deployed draft config names other layers than training used",
       fix="config_ids", changes_plan=True, stage="wiring"),
    _k("fc_bypassed", "tensor", "the draft's fc is bypassed (EAGLE-3 draft served without aux states)", fix="flag",
       checks=("fc_bypass",)),
    _k("mtp_steps_beyond_head", "setup",
       "the MTP head runs more draft steps than it has layers (the engine reuses it on its own output)", fix="flag",
       stage="settings"),
    _k("num_draft_tokens_overridden", "setup", "SGLang overrides the requested number of draft tokens", fix="flag",
       checks=("num_steps_override",), stage="settings"),
    # -- the draft checkpoint ----------------------------------------------------------------------------------
    _k("vocab_map_missing", "draft", "the draft's pruned vocabulary has no d2t map", fix="vocab_map",
       checks=("vocab_map",)),
    _k("lm_head_missing", "draft", "the draft's lm_head is missing and left uninitialised"),
    _k("lm_head_replaced", "draft", "SGLang replaces the draft's trained lm_head"),
    _k("embedding_replaced", "draft", "the engine replaces the MTP head's own embedding copy by the target's"),
    _k("embedding_not_shared", "draft", "the engine keeps the draft checkpoint's own embedding, not the target's",
       fix="drop_tensors", stage="engine"),
    _k("vocab_map_trivial", "draft", "the draft's d2t is all zeros", fix="vocab_map", checks=("vocab_map",)),
    _k("vocab_map_differs", "draft", "the draft's d2t differs from the training data's vocab mapping",
       fix="vocab_map", checks=("vocab_map",)),
    _k("draft_vocab_coverage", "draft", "many target tokens lie outside the draft vocabulary", stage=NO_STAGE),
    _k("draft_weight_missing", "draft", "draft parameters have no tensor in the checkpoint"),
    _k("mtp_weights_missing", "draft", "the checkpoint the engine loads the MTP head from lacks the head's tensors"),
    _k("mtp_layer_folded", "draft",
       "the engine loads several MTP layers of the checkpoint into its one head layer: the one served is not layer 0"),
    _k("draft_weight_ignored", "draft", "the engine's loader drops draft tensors"),
    _k("draft_flag_ignored", "draft", "SGLang ignores a draft config flag"),
    _k("rope_mismatch", "draft", "the draft's rotary embedding differs from the target's"),
    _k("max_position_short", "draft", "the draft's context is shorter than the target's", stage="workload"),
    _k("sliding_window_ignored", "draft", "SGLang ignores the draft's sliding window"),
    # -- the served tensors, most specific explanation first ----------------------------------------------------
    _k("token_mismatch", "setup", "the served tokens differ from the training tokens", fix="engine",
       engine_fix="compare on the same tokens: the served capture and the training data disagree on the token "
                  "ids (tokenizer, chat template or sample order)"),
    _k("nan_or_inf", "tensor", "the served aux states hold NaN / Inf", fix="engine",
       engine_fix="find where non-finite values enter the captured tensor (dtype overflow, an uninitialised "
                  "buffer)", changes_plan=True),
    _k("width_mismatch", "tensor", "the served width differs from the trained width", fix="detail"),
    _k("tp_sharded_width", "tensor", "each TP rank feeds an H/tp shard instead of the full hidden state",
       fix="engine", checks=("tp_sharding",),
       engine_fix="capture the full hidden width on every rank (all-gather, or capture after the all-reduce): "
                  "each TP rank feeds an H/tp shard", changes_plan=True),
    _k("tp_partial_sum", "tensor", "an aux chunk is one TP rank's partial sum, not the all-reduced residual stream",
       aligned=True, fix="engine", checks=("tp_sharding",),
       engine_fix="capture the residual stream after the all-reduce: the chunk holds one rank's partial sum of a "
                  "row-parallel output (o_proj / down_proj), not the full residual stream", changes_plan=True),
    _k("embedding_not_all_reduced", "tensor", "the embedding is fed before its TP all-reduce", fix="engine",
       checks=("embedding_all_reduce",),
       engine_fix="capture the embedding after VocabParallelEmbedding's all-reduce: the chunk holds a rank-local "
                  "lookup (rows of other ranks' vocab shards are zero)", changes_plan=True),
    _k("layer_offset", "tensor", "every aux chunk is a different layer than the draft was trained on",
       layout=True, aligned=True, fix="config_ids", checks=("layer_offset",), changes_plan=True),
    _k("embedding_in_place_of_layer", "tensor",
       "the token embedding is fed where the draft was trained on a layer output", layout=True, fix="config_ids",
       checks=("embedding_included",), changes_plan=True),
    _k("chunk_order", "tensor", "the aux chunks come in another order than in training", layout=True, aligned=True,
       fix="config_ids", checks=("concat_order",), changes_plan=True),
    _k("zero_chunk", "tensor", "an aux chunk is all zeros (the capture delivers nothing there)", fix="engine",
       engine_fix="find why the capture delivers zeros for the chunk (a hook that never fires for that layer, a "
                  "buffer never written or cleared before it is read)", changes_plan=True),
    _k("rotated_basis", "tensor", "an aux chunk is the trained tensor in another basis", aligned=True, fix="engine",
       checks=("rotated_basis",),
       engine_fix="remove the transform applied before capture (or capture before it): the chunk is the trained "
                  "tensor in another orthonormal basis (norms kept, angles changed)", changes_plan=True),
    _k("norm_mismatch", "tensor", "an aux chunk has a normalisation training did not have (or lacks one)",
       aligned=True, fix="engine", checks=("norm_mismatch",),
       engine_fix="capture the pre-norm residual stream training used: the chunk is the trained tensor with a "
                  "normalisation applied (or one missing)", changes_plan=True),
    _k("scaled_chunk", "tensor", "an aux chunk is the trained tensor times a constant", aligned=True, fix="engine",
       engine_fix="remove the constant factor applied to the chunk on one side (a scale folded into the capture, "
                  "a residual added twice, a dtype / quantisation scale not undone)", changes_plan=True),
    _k("partial_match", "tensor", "an aux chunk is the trained tensor except on a minority of rows", aligned=True,
       fix="engine",
       engine_fix="find what alters a minority of the chunk's rows (the evidence names them: often the massive-"
                  "activation rows and dims, altered by clamping, overflow or a special path for some tokens)",
       changes_plan=True),
    _k("unidentified_chunk", "tensor", "an aux chunk holds something that is no layer of the target", aligned=True,
       fix="engine",
       engine_fix="find what transforms the chunk between the residual stream and the capture: it equals no "
                  "layer of the target (compare the TP ranks' captures, read the capture path)", changes_plan=True),
    _k("wrong_layer", "tensor", "an aux chunk holds another layer than the draft was trained on", layout=True,
       aligned=True, fix="config_ids", changes_plan=True),
    _k("extra_chunk", "tensor", "the server feeds an aux chunk training did not have", layout=True, aligned=True,
       fix="config_ids", changes_plan=True),
    _k("missing_chunk", "tensor", "an aux chunk the draft was trained on is missing", layout=True, aligned=True,
       fix="config_ids", changes_plan=True),
    _k("served_draft_differs", "setup", "the server runs another draft than the one given", fix="engine",
       engine_fix="reload the draft: the served draft is not its checkpoint (another folder than the one given, or "
                  "its proposals differ from the checkpoint's on the very states the server fed: weights changed "
                  "after a weight sync, a release / resume or a sleep / wake); restart the server with the draft "
                  "checkpoint, or make the weight update reach the draft model as well"),
    # -- the acceptance budget ----------------------------------------------------------------------------------
    _k("draft_underperforms", "acceptance",
       "the draft checkpoint scores below its training log on rows of the log's kind", stage="draft"),
    _k("wiring_loses_acceptance", "acceptance", "the served aux states cost acceptance against the training states",
       stage="wiring"),
    _k("engine_after_capture", "acceptance",
       "the engine accepts less than the draft run offline on the very states it fed", stage="engine"),
    _k("spec_settings_low", "acceptance", "the speculative settings leave acceptance unused", stage="settings"),
    _k("acceptance_unexplained", "acceptance",
       "live acceptance is below the offline prediction and no stage explains it"),
    _k("workload_loses_acceptance", "acceptance",
       "the requests (their context, temperature), not the server, lose the acceptance", stage="workload"),
    _k("requests_accept_less", "acceptance",
       "the user's requests (--requests) accept materially less than the bundled training-like prompts on the same "
       "server", stage="workload"),
    # -- ablations and workload sweeps (helpers.investigation.ablate): measured on the server ----------------
    _k("context_loses_acceptance", "acceptance", "acceptance falls with the context length", stage="workload"),
    _k("temperature_loses_acceptance", "acceptance", "acceptance falls at the requests' sampling temperature",
       stage="workload"),
    _k("concurrency_loses_acceptance", "acceptance", "acceptance falls when requests share a batch", stage="engine"),
    _k("engine_feature_costs_acceptance", "acceptance",
       "an engine feature costs acceptance: the server with it off accepts more", stage="engine"),
    _k("speculation_slower", "acceptance", "the target alone is faster than with the draft"),
    # -- engine-state probes (helpers.investigation.probes): measured on the server in a condition -------------
    _k("cache_state_loses_acceptance", "acceptance",
       "acceptance falls in a cache state a cold probe never sees (a prefix-cache hit, a prefill in chunks)",
       fix="engine", stage="engine",
       engine_fix="the draft's KV for cached or chunked tokens: the draft's KV pool must hold, for every slot the "
                  "target's KV is reused from, what the draft computes for that token (check the cache restore / "
                  "chunk border path of the draft's KV; --disable-radix-cache or a larger --chunked-prefill-size "
                  "avoids the condition at a prefill cost)"),
    _k("speculation_not_lossless", "acceptance",
       "at temperature 0 speculation emits other tokens than the target alone", fix="engine", stage="engine",
       engine_fix="verification: at temperature 0 the verify step must accept exactly the target's argmax tokens "
                  "(check the verify kernel's comparison, the target's positions and KV in verify)"),
    _k("sampled_verify_loses_acceptance", "acceptance",
       "at temperature > 0 verification accepts fewer drafts than match the tokens it emits", fix="engine",
       stage="engine",
       engine_fix="the sampled verify: with the draft's proposals one-hot (target-only speculative sampling) a draft "
                  "token must be accepted exactly when it is the token emitted at its position (check the coins and "
                  "the accept rule of the sampling verify kernel, and that a rejected draft token is removed from the "
                  "residual the target samples from)"),
    _k("verify_sampling_params_wrong", "acceptance",
       "at temperature > 0 the verify step scales the target's logits by other per-token sampling values (temperature, "
       "top-k, top-p) than the request's", fix="engine", stage="engine",
       engine_fix="the expansion of each request's sampling values to its verify rows: every draft row must be scaled "
                  "by its own request's temperature, top-k and top-p (the finding names the engine function and the "
                  "values it returned; greedy requests are not affected)"),
    _k("engine_integrity_violation", "acceptance",
       "the engine's own integrity check (its KV canary, its invariant checks) fired on a restarted copy serving the "
       "live prompts", fix="engine", stage="engine",
       engine_fix="the engine's KV bookkeeping where the quoted check fired (the log line names the check, the slot "
                  "or page and the SGLang function that raised it): a KV slot that holds another token's KV, a page "
                  "owned and free at once, a pool that does not add up"),
    _k("draft_extend_ids_unshifted", "acceptance",
       "the engine feeds the draft's extend rows the current token instead of the next one (the draft-extend id "
       "shift is lost): the served proposals are the checkpoint's with the ids un-rotated", fix="engine",
       stage="engine",
       engine_fix="the draft extend's input ids: row p must hold the token of position p + 1 with the target's state "
                  "of position p (SGLang rotates the ids left by one per request in sglang/srt/speculative/"
                  "eagle_worker_v2.py::EagleDraftWorker._draft_extend_for_prefill, and after a verify feeds the tokens "
                  "verification emitted, _draft_extend_for_decode); an MTP / NextN head then reads enorm(embed(x_{p+1})) "
                  "with hnorm(h_p)"),
    _k("draft_kv_diverges", "acceptance",
       "the served draft's proposals match the checkpoint at step 1 but not from step 2 on: the draft's own KV or "
       "positions (or a weights change too small to move step 1)", fix="engine", stage="engine",
       engine_fix="the draft's decode steps: each draft step must write its KV to its own slot (out_cache_loc of "
                  "that step) at its own position and attend to the context's draft KV and its ancestors' (check the "
                  "draft decode's cache locations, positions and attention metadata: the step trace names the first "
                  "diverging step and position)"),
)

#: name -> :class:`Kind`
BY_NAME: dict[str, Kind] = {k.name: k for k in KINDS}
if len(BY_NAME) != len(KINDS):                                                       # pragma: no cover
    raise RuntimeError("helpers/kinds.py: a finding kind is declared twice")

# -- derived views (one-liners; the declarations above are the only source) --------------------------------------
FINDING_KINDS: tuple[str, ...] = tuple(BY_NAME)
LAYOUT_KINDS: tuple[str, ...] = tuple(k.name for k in KINDS if k.layout)
ALIGNED_KINDS: tuple[str, ...] = tuple(k.name for k in KINDS if k.aligned)
TENSOR_KINDS: frozenset[str] = frozenset(k.name for k in KINDS if k.group == "tensor")
DRAFT_KINDS: tuple[str, ...] = tuple(k.name for k in KINDS if k.group == "draft")
ACCEPTANCE_KINDS: tuple[str, ...] = tuple(k.name for k in KINDS if k.group == "acceptance")
#: findings a change of the draft config ids can address (when the served chunks follow SGLang's rules)
ID_KINDS: frozenset[str] = frozenset(k.name for k in KINDS if k.fix == "config_ids")
VOCAB_MAP_KINDS: tuple[str, ...] = tuple(k.name for k in KINDS if k.fix == "vocab_map")
#: findings about which tensor the draft receives: a fix for them changes the served plan
PLAN_KINDS: frozenset[str] = frozenset(k.name for k in KINDS if k.changes_plan)
ENGINE_FIXES: dict[str, str] = {k.name: k.engine_fix for k in KINDS if k.engine_fix}
KIND_TEXT: dict[str, str] = {k.name: k.text for k in KINDS}


def kind_words(kind: str, evidence: Optional[dict] = None) -> str:
    """The sentence's words for a finding of ``kind``: its evidence's ``kind_text`` when the finding's draft family
    has its own (an MTP head is fed a state, it has no aux chunk), else :data:`KIND_TEXT`'s, else the kind itself."""
    return (evidence or {}).get("kind_text") or KIND_TEXT.get(kind, kind)


#: kind -> the acceptance budget stage where it costs accepted tokens (kinds with one only)
KIND_STAGE: dict[str, str] = {k.name: k.stage for k in KINDS if k.stage}
#: check -> the kinds that say what the check asks (in report order)
CHECK_FINDINGS: dict[str, tuple[str, ...]] = {
    c: tuple(k.name for k in KINDS if c in k.checks) for c in dict.fromkeys(c for k in KINDS for c in k.checks)}


def report_rank(kind: str) -> int:
    """Position of ``kind`` in the report order (:data:`KINDS`); an undeclared name sorts last."""
    return _RANK.get(kind, len(_RANK))


def sort_findings(findings: list) -> list:
    """Findings (dicts with ``kind`` and ``chunk``) in report order, whole-width findings (chunk None) before
    chunk 0 within a kind, otherwise stable."""
    return sorted(findings, key=lambda f: (report_rank(f["kind"]), -1 if f["chunk"] is None else f["chunk"]))


def check_kind(kind: str) -> str:
    """``kind`` if declared, else ValueError naming it (the validator of :class:`helpers.records.Finding`)."""
    if kind not in BY_NAME:
        raise ValueError(f"unknown finding kind {kind!r}; expected one of helpers/kinds.py KINDS")
    return kind


_RANK = {k.name: n for n, k in enumerate(KINDS)}
