"""vLLM 0.32.0's draft loader rule table: which embedding, lm_head, d2t and norms vLLM runs an EAGLE-3 draft with
(SGLang 0.5.23's is :class:`helpers.draft.checks.LoaderRules` ``TABLE``). It lives with the offline draft run, which
follows it for a draft vLLM serves (:meth:`helpers.draft.model.Eagle3Draft.load`); the engine adapter hands it out
through ``helpers.engines.vllm_rules.VLLMLoaderRules`` (``EngineAdapter.loader_rules``). The rules are read in
vLLM 0.32.0's ``model_executor/models/llama_eagle3.py`` (``Eagle3LlamaForCausalLM.__init__`` / ``load_weights`` /
``compute_logits``, ``LlamaModel.__init__``, ``LlamaDecoderLayer``), ``model_executor/models/utils.py``
(``process_eagle_weight``, ``AutoWeightsLoader``) and ``v1/spec_decode/llm_base_proposer.py``
(``SpecDecodeBaseProposer._maybe_share_embeddings`` / ``_maybe_share_lm_head``), through
:mod:`helpers.layers.vllm`."""
from __future__ import annotations

from typing import Any, Optional, Sequence

from ..errors import BadInput
from ..layers import vllm as rules


class VLLMLoaderTable:
    """vLLM's loader rule table (``TABLE``) and its application to a draft config (:meth:`draft_norms`) and its
    checkpoint's tensor names (:meth:`draft_tensors`); ``label`` ``vLLM``, ``version`` a release whose rules are
    known (default 0.32.0)."""

    label = "vLLM"

    def __init__(self, version: Optional[str] = None) -> None:
        # a release whose rules are known, else 0.32.0's (never SGLang's default release string)
        self.version = version if rules.is_known(version) else "0.32.0"

    #: the loader rule table (:class:`helpers.draft.checks.LoaderRules` ``TABLE``: SGLang's rows), vLLM 0.32.0's
    TABLE = {
        "embedding": "no embed_tokens in the checkpoint: the target's (when as wide); its own and torch.equal to the "
                     "target's: the target's; its own and unlike the target's, or of another width: the checkpoint's "
                     f"({rules.SOURCES['own_weights']}; {rules.SOURCES['embed_share']})",
        "lm_head": "no lm_head in the checkpoint: the target's, all its rows (tie_word_embeddings and "
                   "draft_vocab_size do not change that); its own: the checkpoint's, draft_vocab_size absent or not "
                   f"({rules.SOURCES['own_weights']}; {rules.SOURCES['lm_head_share']})",
        "d2t": "draft_vocab_size (default the config's vocab_size) below the target's vocab: the checkpoint's d2t, "
               "else zeros (draft ids are target ids); equal: no map, and a checkpoint d2t is refused at load "
               f"(AutoWeightsLoader: no parameter draft_id_to_target_id) ({rules.SOURCES['d2t']})",
        "t2d": f"skipped ({rules.SOURCES['d2t']})",
        "norm_before_residual": "the config's norm_before_residual, default false (a speculators config's default "
                                "true: transformers_utils/configs/speculators/algos.py::update_eagle3): the first "
                                "layer's residual is the hidden state after hidden_norm "
                                "(llama_eagle3.py::LlamaDecoderLayer._norm_before_residual)",
        "fc_norm": "fc_norm only; the legacy use_aux_norm is not read, and the per-chunk norm tensors of such a "
                   "checkpoint are refused at load (llama_eagle3.py::LlamaModel.__init__; "
                   "models/utils.py::AutoWeightsLoader._load_module: no module or parameter named ...)",
    }

    def draft_norms(self, d: Any) -> dict[str, bool]:
        """The :data:`TABLE` norm rows for draft config ``d`` (``{"norm_before_residual", "fc_norm"}``, bools).

        Raises:
            BadInput: ``use_aux_norm`` set without ``fc_norm``: vLLM builds no per-chunk norm and refuses the
                checkpoint's (the config field named)."""
        raw = d.raw
        if raw.get("use_aux_norm") and not raw.get("fc_norm"):
            raise BadInput("use_aux_norm is set but fc_norm is not: vLLM 0.32.0 reads fc_norm only, builds no "
                           "per-chunk norm and refuses the checkpoint's (llama_eagle3.py::LlamaModel.__init__; "
                           "AutoWeightsLoader: no module or parameter named 'model.fc_norm'); set fc_norm: true",
                           path=d.path, field="use_aux_norm")
        return {"norm_before_residual": bool(raw.get("norm_before_residual", False)),
                "fc_norm": bool(raw.get("fc_norm", False))}

    def draft_tensors(self, d: Any, names: Sequence[str], *, embed_equal: Optional[bool] = None) -> dict[str, str]:
        """The :data:`TABLE` tensor rows for draft config ``d`` and checkpoint tensor ``names`` (``embed_equal``:
        the checkpoint's own embed_tokens is ``torch.equal`` to the target's; None when unknown, read as unlike):
        ``{"embedding": "target"|"draft", "lm_head": "draft"|"target", "d2t": "checkpoint"|"none"}``.

        Raises:
            BadInput: a draft vLLM 0.32.0 refuses or serves untrained: no lm_head and ``draft_vocab_size`` below the
                target's vocab (the d2t scatter fails at the first request), a d2t with ``draft_vocab_size`` equal
                to the vocab (refused at load), no embed_tokens and a draft width unlike the target's (the
                embedding keeps its initial values)."""
        width_equal = int(d.raw.get("target_hidden_size") or d.hidden_size) == int(d.hidden_size)
        share = rules.weight_sharing(list(names), embed_equal=bool(embed_equal), lm_head_equal=False,
                                     embed_width_equal=width_equal, version=rules.rule_version(self.version))
        if share["embedding"] == "draft" and not any("embed_tokens" in k for k in names):
            raise BadInput("no embed_tokens in the checkpoint and the draft's width differs from the target's: vLLM "
                           f"keeps its embedding's initial values ({rules.SOURCES['embed_share']})", path=d.path,
                           field="embed_tokens.weight")
        vocab = int(d.vocab_size or 0)
        dv = int(d.draft_vocab_size or vocab)
        if share["lm_head"] == "target" and dv != vocab:
            raise BadInput(f"no lm_head in the checkpoint: vLLM gives the draft the target's ({vocab} rows) and the "
                           f"d2t scatter of {dv} draft ids fails at the first request "
                           "(Eagle3LlamaForCausalLM.compute_logits)", path=d.path, field="lm_head.weight")
        how = rules.d2t_rule(list(names), d.draft_vocab_size, vocab, rules.rule_version(self.version))
        if how == "none" and any("d2t" in k for k in names):
            raise BadInput(f"draft_vocab_size equals the vocab ({vocab}) but the checkpoint has a d2t: vLLM builds no "
                           "draft_id_to_target_id and refuses the tensor at load (AutoWeightsLoader: no module or "
                           "parameter named 'draft_id_to_target_id')", path=d.path, field="d2t")
        return {"embedding": share["embedding"], "lm_head": share["lm_head"],
                "d2t": "checkpoint" if how == "checkpoint" else "none"}
