"""SGLang release facts the whole tool reads: version parsing, and what a given SGLang release does with an EAGLE-3
draft's layer ids, per target architecture (the target family) and which draft classes it serves. Imports nothing of
``helpers``.

Two sources, both read from SGLang's own code:

* the **architecture table** ``helpers/layers/data/sglang-0.5.23-eagle3.json``, derived by
  ``env/reference/sglang_tables.py`` from the installed ``sglang==0.5.23`` source: for every registered
  model class (``EntryClass`` of ``sglang/srt/models/*.py``) the ``set_eagle3_layers_to_capture`` it has (own
  or inherited), its id rule and what an id naming the last layer does; and the EAGLE-3 draft classes;
* **version gates**, found by reading the same functions in the published wheels of neighbouring releases
  (``pip download --no-deps sglang==X``), each stated with the first release that has the new behaviour:

  ==========================  ===========  ===============================================================
  rule                        since        where
  ==========================  ===========  ===============================================================
  DeepSeek family: +1 only    0.5.13       ``models/deepseek_v2.py::set_eagle3_layers_to_capture``
  when the first id is 1                   (``if layer_ids and layer_ids[0] == 1``; PR 25454). 0.5.12 and
  (else ids as-is)                         older add +1 to every explicit id.
  gpt-oss: ids kept when      0.5.17       ``models/gpt_oss.py`` (``max(layer_ids) == num_layers``) and the
  max id == n; index n =                   final-boundary capture in ``GptOssModel.forward``; 0.5.16 and
  final boundary (pre-norm)                older add +1 and never reach index n.
  Llama-style capture index   0.5.22       ``layers/layer_boundary/stage.py`` (capture of the stream's
  0 = the embedding                        residual; at layer 0 the embedding). 0.5.21 and older compute
                                           ``hidden_states + residual`` with residual None: TypeError.
  ==========================  ===========  ===============================================================

Releases older than 0.5.6 were not read; their rules are assumed to be those of 0.5.6 - 0.5.12 and the
plans say so. Architectures are assumed to keep their 0.5.23 rule in other releases (noted in every plan
built for another version).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Optional, Sequence

TABLE_VERSION = (0, 5, 23)
TABLE_PATH = Path(__file__).resolve().parent / "data" / "sglang-0.5.23-eagle3.json"
#: first release with the DeepSeek-family conditional +1 (read in the 0.5.12 and 0.5.13 wheels).
DEEPSEEK_CONDITIONAL_SINCE = (0, 5, 13)
#: first release with gpt-oss's final-boundary semantics (read in the 0.5.16 and 0.5.17 wheels).
GPT_OSS_BOUNDARY_SINCE = (0, 5, 17)
#: first release where capture index 0 gives the embedding on Llama-style models (0.5.21 / 0.5.22 wheels).
EMBEDDING_AT_INDEX0_SINCE = (0, 5, 22)
#: the oldest release whose source was read for these rules.
OLDEST_READ = (0, 5, 6)
#: the release read with DeepSeek's AuxHiddenStatePacker (an id the layer loop never reaches: RuntimeError at the
#: first forward; older releases were not read for it and are assumed to leave the chunk out silently).
PACKER_SINCE = (0, 5, 23)

RULE_TEXT = {
    "plus_one": "config id i -> capture index i+1 = out(i)",
    "deepseek": "+1 only when the first id is 1 (output-of-layer ids), else ids are capture indices",
    "gpt_oss": "ids are capture boundaries when max(id) == num_layers (index n = final boundary), else +1",
    "plus_one_default": "+1 for explicit ids and for the default [2, n//2, n-3] too",
    "none": "no set_eagle3_layers_to_capture: EAGLE-3 refused at start-up",
}


@lru_cache(maxsize=1)
def table() -> dict:
    """The architecture table (parsed JSON)."""
    return json.loads(TABLE_PATH.read_text())


@dataclass(frozen=True)
class TargetRule:
    """How SGLang converts a target's EAGLE-3 layer ids.

    Attributes:
        architecture: the architecture looked up (the config's first known one).
        rule: ``plus_one`` | ``deepseek`` | ``gpt_oss`` | ``plus_one_default`` | ``none`` (refuses EAGLE-3) |
            ``unregistered`` (not a model class of SGLang 0.5.23: the Transformers fallback backend, which has
            no ``set_eagle3_layers_to_capture``, so EAGLE-3 is refused too).
        last_layer: what capture index n (an id naming out(n-1) under +1) does: ``missing`` (the loop never
            reaches it: the chunk is silently absent), ``index_error`` (start-up crash), ``boundary``
            (captured, pre-norm), ``runtime_error`` (the captures fill an ``AuxHiddenStatePacker`` sized by the
            ids, whose ``finalize`` raises RuntimeError "captured k of m aux hidden states" at the first forward,
            i.e. SGLang's start-up warm-up: ``models/deepseek_v2.py::DeepseekV2Model.forward``, SGLang >= 0.5.23,
            checked live), ``unknown``, or None.
        source: the SGLang file and method the rule comes from.
    """

    architecture: Optional[str]
    rule: str
    last_layer: Optional[str]
    source: str

    @property
    def supports_eagle3(self) -> bool:
        return self.rule not in ("none", "unregistered")


#: model_type -> architecture, for target configs without ``architectures`` (HF config ``model_type``).
_MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                "qwen3": "Qwen3ForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                "qwen3_next": "Qwen3NextForCausalLM", "deepseek_v2": "DeepseekV2ForCausalLM",
                "deepseek_v3": "DeepseekV3ForCausalLM", "deepseek_v32": "DeepseekV32ForCausalLM",
                "kimi_k25": "KimiK25ForConditionalGeneration", "gpt_oss": "GptOssForCausalLM",
                "glm4_moe": "Glm4MoeForCausalLM", "glm4_moe_lite": "Glm4MoeLiteForCausalLM",
                "longcat_flash": "LongcatFlashForCausalLM", "phi3": "Phi3ForCausalLM"}


def target_rule(architectures: Optional[Sequence[str]], model_type: Optional[str] = None) -> TargetRule:
    """Look the target up in the 0.5.23 architecture table (first architecture SGLang registers; else by
    ``model_type``). An unknown architecture gives rule ``unregistered``."""
    targets = table()["targets"]
    archs = [a for a in (architectures or []) if a]
    for a in archs:
        if a in targets:
            t = targets[a]
            return TargetRule(a, t["rule"], t.get("last_layer"), t.get("method_in") or t["file"])
    mt = (model_type or "").lower()
    if not archs and mt in _MODEL_TYPES and _MODEL_TYPES[mt] in targets:
        a = _MODEL_TYPES[mt]
        t = targets[a]
        return TargetRule(a, t["rule"], t.get("last_layer"), (t.get("method_in") or t["file"]) +
                          f" (architecture inferred from model_type {mt!r})")
    name = archs[0] if archs else None
    return TargetRule(name, "unregistered", None,
                      "sglang/srt/models/registry.py (not registered: Transformers fallback backend, "
                      "model_loader/utils.py::resolve_transformers_arch) + model_executor/"
                      "model_runner_components/attention_backend_setup.py::configure_aux_hidden_state_capture")


def eagle3_draft_classes() -> list[str]:
    """Architectures SGLang 0.5.23 serves as an EAGLE-3 draft (``EntryClass`` of ``models/*eagle3*.py``)."""
    return [d["architecture"] for d in table()["eagle3_drafts"]]


def parse_version(version: str | Sequence[int] | None) -> tuple[int, ...] | None:
    """``"0.5.23"`` / ``"0.5.23.post1"`` / ``(0, 5, 23)`` -> ``(0, 5, 23)``; None -> None.

    Raises:
        ValueError: no leading ``X.Y[.Z]`` in the string.
    """
    if version is None:
        return None
    if not isinstance(version, str):
        return tuple(int(v) for v in version)
    m = re.match(r"^\s*v?(\d+)\.(\d+)(?:\.(\d+))?", version)
    if not m:
        raise ValueError(f"cannot read an X.Y.Z version from {version!r}")
    return tuple(int(g) for g in m.groups(default="0"))


def target_family(architectures: Sequence[str] | None, model_type: str | None = None) -> str:
    """The SGLang 0.5.23 id rule of a target: ``plus_one`` | ``deepseek`` | ``gpt_oss`` | ``plus_one_default``
    | ``none`` (refuses EAGLE-3) | ``unregistered`` (see :func:`target_rule`)."""

    return target_rule(architectures, model_type).rule
