"""Whether SGLang can load a draft as an EAGLE-3 draft, in one sentence naming the SGLang file: the diagnosis's
reading of the rule table of :mod:`helpers.layers.sglang` (the table itself, version gates and target rules live
there, below formats and server)."""
from __future__ import annotations

from typing import Optional, Sequence

from ..layers.sglang import eagle3_draft_classes, table


def draft_servable(architectures: Sequence[str], form: str) -> Optional[str]:
    """None when SGLang can load this draft as an EAGLE-3 draft, else why not (one sentence, with the file).

    Args:
        architectures: the draft config's ``architectures``.
        form: :attr:`helpers.formats.configs.DraftConfig.form` (``sglang`` | ``eagle`` | ``speculators``).
    """
    ok = eagle3_draft_classes()
    archs = [a for a in architectures if a]
    if archs and archs[0] in ok:
        return None
    where = ", ".join(f"{d['architecture']} ({d['file']})" for d in table()["eagle3_drafts"])
    if form == "speculators":
        return (f"a speculators-format draft (architectures {archs or '[]'}, speculators_model_type): SGLang has no "
                "reader for it (the model class comes from architectures: sglang/srt/model_loader/utils.py::"
                "get_model_architecture; no SGLang file reads speculators_model_type or transformer_layer_config) "
                f"and serves EAGLE-3 only through {where}; convert its config to the SGLang layout first")
    if not archs:
        return f"the draft config names no architecture; SGLang serves EAGLE-3 through {where}"
    targets = table()["targets"]
    if archs[0] in targets:
        return (f"architecture {archs[0]} is a model class of SGLang ({targets[archs[0]]['file']}) but not an EAGLE-3 "
                f"draft: loaded as the draft it gets no aux hidden states through fc; SGLang's EAGLE-3 drafts are "
                f"{where}" + (" (an original EAGLE-3 config: rename the architecture to LlamaForCausalLMEagle3)"
                              if form == "eagle" else ""))
    return (f"architecture {archs[0]} is not registered in SGLang 0.5.23 (sglang/srt/models/registry.py): the server "
            f"cannot load it as an EAGLE-3 draft; SGLang's EAGLE-3 drafts are {where}")
