"""Static detectors (no tensors): configs, SGLang's rules and the two capture plans.

:func:`detect_unsupported_draft`, :func:`detect_config_ids_ignored`, :func:`detect_fc_bypassed` (the server-algorithm part; with a
:class:`~helpers.diagnosis.detectors.context.Context` it also checks the served width),
:func:`detect_vocab_map_missing`, :func:`detect_num_draft_tokens_overridden` and :func:`static_layer_findings`
(width, chunk count, layers from the served and training plans).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from ...formats.speculators import sglang_conversion
from ...layers.ids import EMBEDDING, FINAL_NORM, LayerIds, sglang_default_capture
from ..conventions import CapturePlan, compare_plans, describe
from ..sglang_rules import draft_servable
from .base import finding

if TYPE_CHECKING:                                   # the Context type only, for the signature (no import cycle)
    from .context import Context


def detect_unsupported_draft(draft) -> list[dict]:
    """``unsupported_draft``: SGLang cannot load this draft config as an EAGLE-3 draft (its first architecture is
    not one of SGLang's EAGLE-3 draft classes: :func:`helpers.diagnosis.sglang_rules.draft_servable`, read from
    ``sglang/srt/models/registry.py`` and the ``EntryClass`` of ``models/llama_eagle3.py`` / ``kimi_k25_eagle3.py``).
    The one builder of this finding: the static check and the draft checks both call it. An MTP / NextN head
    (``draft.form == "mtp"``: :mod:`helpers.layers.mtp`) is another draft family, never this finding:
    :mod:`helpers.draft.mtp_checks` says what the engine makes of it."""
    if draft is None or draft.form == "mtp":
        return []
    why = draft_servable(draft.architectures, draft.form)
    if why is None:
        return []
    extra: dict = {}
    if getattr(draft, "speculators", None) is not None:
        # SGLang 0.5.23 has no speculators reader: the config class comes from model_type
        # (utils/hf_transformers/common.py _CONFIG_REGISTRY), the model class from architectures
        # (model_loader/utils.py::get_model_architecture -> models/registry.py); no SGLang file names speculators
        cfg, text = sglang_conversion(draft)
        extra = {"fix": text, "sglang_config": cfg}
    return [finding("unsupported_draft", None, f"SGLang cannot serve this draft as EAGLE-3: {why}",
                    architectures=draft.architectures, form=draft.form, config=str(draft.path),
                    source="sglang/srt/models/registry.py; models/llama_eagle3.py, kimi_k25_eagle3.py", **extra)]


def detect_config_ids_ignored(draft, target, served: Optional[CapturePlan] = None) -> list[dict]:
    """``config_ids_ignored``: ids sit at the top level of the draft config (speculators / vLLM style) with no
    nested ``eagle_config``; SGLang reads only ``eagle_config.eagle_aux_hidden_state_layer_ids`` inside a bare
    ``try/except`` and silently uses its default (``spec_aux_hidden_state.py::_resolve_eagle_aux_hidden_state``).

    Reported only when the ignored ids name other tensors than the default SGLang then captures (ids read
    in the convention of the config's form: speculators form = vllm in(i), SGLang/SpecForge form = out(i)).
    """
    if draft is None or target is None or draft.top_level_layer_ids is None or draft.nested_layer_ids is not None:
        return []

    n = target.num_hidden_layers
    conv = "vllm" if draft.form == "speculators" else "specforge"
    meant = []
    for i in sorted(set(draft.top_level_layer_ids)):
        try:
            meant.append(LayerIds((i,), conv).tensors(n)[0])
        except ValueError:
            meant.append(f"<{conv} id {i}: no such tensor>")
    default = served.tensors if served is not None else sglang_default_capture(n).tensors(n)
    if meant == list(default):
        return []
    return [finding("config_ids_ignored", None,
                    f"draft config has top-level eagle_aux_hidden_state_layer_ids {list(draft.top_level_layer_ids)} "
                    f"but no eagle_config: SGLang ignores them and captures its default {describe(default)} instead "
                    f"of {describe(meant)}",
                    config=str(draft.path), top_level_ids=list(draft.top_level_layer_ids), read_as=conv,
                    meant=meant, served=list(default),
                    source="sglang/srt/model_executor/model_runner_components/spec_aux_hidden_state.py::"
                           "_resolve_eagle_aux_hidden_state",
                    fix='move the ids under "eagle_config": {"eagle_aux_hidden_state_layer_ids": [...]} '
                        "(in SpecForge out(i) numbering)")]


def detect_vocab_map_missing(draft, weights) -> list[dict]:
    """``vocab_map_missing``: ``draft_vocab_size < vocab_size`` but the weights carry no ``d2t``; SGLang then
    has no ``hot_token_id`` and the draft's top-k ids are not mapped to target ids
    (``sglang/srt/models/llama_eagle3.py::load_weights``; ``eagle_worker_v2.py::draft_forward``)."""
    if draft is None or weights is None:
        return []
    dv, v = draft.draft_vocab_size, draft.vocab_size
    if dv is None or v is None or dv >= v or weights.d2t_shape is not None:
        return []
    return [finding("vocab_map_missing", None,
                    f"pruned draft vocab ({dv} < target vocab {v}) but no d2t tensor in the draft weights: draft "
                    "token ids would be used as target ids",
                    draft_vocab_size=dv, vocab_size=v, weights=[str(f) for f in weights.files],
                    t2d_present=weights.t2d_shape is not None,
                    source="sglang/srt/models/llama_eagle3.py::LlamaForCausalLMEagle3.load_weights (d2t -> "
                           "hot_token_id; t2d ignored)")]


def detect_num_draft_tokens_overridden(server) -> list[dict]:
    """``num_draft_tokens_overridden``: with ``--speculative-eagle-topk 1`` SGLang resets
    ``speculative_num_draft_tokens`` to ``speculative_num_steps + 1`` and only logs a warning
    (``sglang/srt/arg_groups/speculative_hook.py::_handle_eagle_family``, 0.5.23)."""
    if server is None:
        return []
    req = server.requested or {}
    algo = (req.get("speculative_algorithm") or server.algorithm or "").upper()
    if algo and algo not in ("EAGLE", "EAGLE3", "NEXTN"):
        return []
    topk = req.get("speculative_eagle_topk", server.topk)
    steps = req.get("speculative_num_steps", server.num_steps)
    ndt = req.get("speculative_num_draft_tokens")
    if topk != 1 or steps is None or ndt is None or ndt == steps + 1:
        return []
    return [finding("num_draft_tokens_overridden", None,
                    f"--speculative-num-draft-tokens {ndt} with topk 1 is overridden to num_steps+1 = {steps + 1}",
                    requested=ndt, effective=server.num_draft_tokens if server.num_draft_tokens is not None
                    else steps + 1, num_steps=steps, topk=topk,
                    source="sglang/srt/arg_groups/speculative_hook.py::_handle_eagle_family",
                    log='"speculative_num_draft_tokens is adjusted to speculative_num_steps + 1 when '
                        'speculative_eagle_topk == 1"')]


def detect_fc_bypassed(draft=None, server=None, ctx: Optional["Context"] = None, weights=None,
                       target=None) -> list[dict]:
    """``fc_bypassed``: an EAGLE-3 draft receives one H-wide state (``--speculative-algorithm EAGLE``/NEXTN, or
    ``use_aux_hidden_state: false``) as wide as its own hidden size, so ``llama_eagle3.py`` skips ``fc``
    (``if hidden_states.shape[-1] != embeds.shape[-1]``) and the draft runs on features it never saw.

    Static evidence: the server's algorithm / the config flag, and the fed width: the target's ``hidden_size``
    (``target``; else the draft's ``target_hidden_size``). When the fed width differs from the draft's hidden
    size, fc runs on it: fine when fc takes that width (no finding: a layout question), otherwise a shape error
    at the first draft forward, returned as a static ``width_mismatch`` whose evidence carries ``fatal`` (the
    server does not serve). Numeric evidence (``ctx``): the served width equals the draft hidden size while fc
    expects more.
    """
    if draft is None or not draft.is_eagle3:
        return []
    fc_in = weights.fc_shape[1] if weights is not None and weights.fc_shape else draft.sglang_fc_in_features
    algo = server.algorithm if server is not None else None
    static_cause = (f"--speculative-algorithm {algo}" if algo in ("EAGLE", "NEXTN") else
                    "eagle_config.use_aux_hidden_state=false" if draft.use_aux_hidden_state is False else None)
    ev: dict = {"draft_hidden_size": draft.hidden_size, "fc_in_features": fc_in,
                "source": "sglang/srt/models/llama_eagle3.py::LlamaModel.forward (fc only if width != embeds width)"}
    if ctx is not None:
        served_w = ctx.cmp.served_width
        if not (served_w == draft.hidden_size and served_w < fc_in):
            return []
        ev["served_width"] = served_w
        ident = ctx.cmp.identify(ctx.source.ref, 0)
        if ident:
            ev["served_identified_as"] = ident.best
        cause = static_cause or f"the server feeds one {served_w}-wide state"
    else:
        if static_cause is None:
            return []
        fed = target.hidden_size if target is not None else draft.sglang_hidden_size_in
        if fed != draft.hidden_size:
            if target is None or fc_in == fed:
                return []
            msg = (f"{static_cause}: the server feeds one {fed}-wide state ({FINAL_NORM}, the target's hidden size); "
                   f"it differs from the draft's embedding width {draft.hidden_size}, so llama_eagle3.py applies fc, "
                   f"which takes {fc_in}: shape error (RuntimeError, mat1 and mat2 shapes cannot be multiplied) at the "
                   f"first draft forward -- {ev['source']}")
            return [finding("width_mismatch", None, msg, static=True, fatal=msg, fed_width=fed,
                            draft_hidden_size=draft.hidden_size, fc_in_features=fc_in,
                            target_config_hidden_size=fed, source=ev["source"])]
        ev["fed_width"] = fed
        cause = static_cause
    if static_cause:
        ev["speculative_algorithm"] = algo
        ev["use_aux_hidden_state"] = draft.use_aux_hidden_state
    return [finding("fc_bypassed", None,
                    f"{cause}: the EAGLE-3 draft gets a single H-wide hidden state instead of "
                    f"{fc_in // max(1, draft.sglang_hidden_size_in)} aux chunks, so SGLang skips fc silently", **ev)]


def static_layer_findings(served: CapturePlan, trained: Optional[CapturePlan], draft=None, weights=None,
                          target=None) -> list[dict]:
    """Static layer / width findings from the two capture plans and the draft's fc (no tensors).

    * ``width_mismatch``: fc ``in_features`` (weights) vs SGLang's Linear(``hidden_size_in * num_aux``)
      (config), and vs the served plan's chunk count x target H;
    * ``missing_chunk`` / ``extra_chunk`` / ``layer_offset`` / ``wrong_layer`` / ``chunk_order`` /
      ``embedding_in_place_of_layer``: position-wise comparison of the served and training plans (the
      plans' own problems, e.g. an unreachable capture index, are attached as evidence).
    """
    out: list[dict] = []
    H = target.hidden_size if target is not None else None
    if draft is not None and H is not None and served.tensors and served.tensors != [FINAL_NORM]:
        fc_in = weights.fc_shape[1] if weights is not None and weights.fc_shape else None
        built = draft.sglang_fc_in_features
        served_w = served.num_chunks * H
        if fc_in is not None and fc_in != built:
            out.append(finding("width_mismatch", None,
                               f"fc.weight has in_features {fc_in} but SGLang builds Linear({built}) "
                               f"(= {draft.sglang_hidden_size_in} x {draft.sglang_num_aux}; "
                               f"target_hidden_size {'missing' if draft.target_hidden_size is None else 'set'}): "
                               "the weights will not load or the width is wrong",
                               static=True, fc_in_features=fc_in, sglang_fc_in_features=built,
                               draft_hidden_size=draft.hidden_size, target_hidden_size=draft.target_hidden_size,
                               target_config_hidden_size=H, sglang_num_aux=draft.sglang_num_aux,
                               source="sglang/srt/models/llama_eagle3.py::LlamaModel.__init__"))
        expect = fc_in if fc_in is not None else built
        if served_w != expect:
            out.append(finding("width_mismatch", None,
                               f"the server will feed {served.num_chunks} chunks x {H} = {served_w} but the draft's fc "
                               f"takes {expect}",
                               static=True, served_plan=served.tensors, served_width=served_w, fc_in_features=expect,
                               problems=served.problems, fatal=served.fatal))
    if trained is None or not trained.tensors:
        for p in served.problems:
            out.append(finding(p["kind"], None, p["detail"], static=True, served_plan=served.tensors,
                               rules=served.rules))
        return out
    rows = compare_plans(served, trained)
    ns, nt = served.num_chunks, trained.num_chunks
    ev = {"static": True, "served_plan": served.tensors, "training_plan": trained.tensors,
          "served_ids": None if served.engine_ids is None else str(served.engine_ids),
          "training_ids": None if trained.config_ids is None else str(trained.config_ids),
          "rules": served.rules, "plan_problems": served.problems, "fatal": served.fatal}
    same = [r for r in rows if r["served"] is not None and r["served"] == r["training"]]
    if len(same) == len(rows):
        return out + _unreachable(served, out)
    s_set, t_set = set(served.tensors), set(trained.tensors)
    offsets = [r["offset"] for r in rows[:min(ns, nt)]]
    if min(ns, nt) > 0 and all(o is not None and o == offsets[0] and o != 0 for o in offsets) \
            and EMBEDDING not in s_set:
        for r in rows[:min(ns, nt)]:
            out.append(finding("layer_offset", r["index"],
                               f"the server will feed {r['served']} where training used {r['training']} "
                               f"(offset {offsets[0]:+d} layer)", offset=offsets[0], **ev))
    else:
        moved = {}
        for r in rows:
            s, t = r["served"], r["training"]
            if s is None or s == t:
                continue
            if s == EMBEDDING and EMBEDDING not in t_set:
                if ns > nt and t_set <= s_set:
                    out.append(finding("extra_chunk", r["index"], "the server will feed the embedding output as an "
                                       "extra chunk", **ev))
                else:
                    out.append(finding("embedding_in_place_of_layer", r["index"],
                                       f"the server will feed the embedding output where training used "
                                       f"{t or 'nothing'}", **ev))
            elif s in t_set:
                moved[r["index"]] = trained.tensors.index(s)
            elif t is None:
                out.append(finding("extra_chunk", r["index"], f"the server will feed an extra chunk {s}", **ev))
            else:
                out.append(finding("wrong_layer", r["index"], f"the server will feed {s} where training used {t}"
                                   + (f" (offset {r['offset']:+d})" if r["offset"] is not None else ""),
                                   offset=r["offset"], **ev))
        if moved:
            out.append(finding("chunk_order", None,
                               "chunks reach the draft in another order than in training: "
                               + ", ".join(f"served chunk {i} = training chunk {j}" for i, j in moved.items()),
                               mapping=moved, **ev))
    for j, t in enumerate(trained.tensors):
        if t not in s_set and (j >= ns or served.tensors[j] in t_set):
            out.append(finding("missing_chunk", None, f"training chunk {j} ({t}) is not fed by the server",
                               training_chunk=j, tensor=t, **ev))
    return out + _unreachable(served, out)


def _unreachable(served: CapturePlan, found: list[dict]) -> list[dict]:
    """Served-plan problems not yet reported: an id naming no layer of this target is a finding, never a silently
    dropped chunk."""
    if any(f["kind"] == "missing_chunk" for f in found):
        return []
    return [finding("missing_chunk", None, f"{p['detail']} (config ids {served.config_ids}, capture indices "
                    f"{served.engine_ids})", static=True, served_plan=served.tensors, rules=served.rules,
                    fatal=served.fatal) for p in served.problems if p["kind"] == "missing_chunk"]
