"""Readers for the draft config.json (SGLang/SpecForge, original EAGLE, speculators forms), the draft
weights (safetensors headers: fc shape, d2t/t2d), the target config.json, and the server settings.

Every reader validates and raises :class:`helpers.errors.BadInput` naming the file and field and what was
expected. No tensor data is loaded except the small ``d2t`` vector when asked.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from safetensors import safe_open

from ..errors import BadInput
from ..layers.mtp import MAX_HIDDEN_LAYERS, MAX_MTP_LAYERS, MTPHead, family_of, mtp_head
from ..layers.mtp import text_config as mtp_text_config
from ..layers.sglang import target_family
from ..runfiles import read_json_file, regular_file
from .speculators import is_speculators, vllm_view

# ----------------------------------------------------------------------------------------------- helpers


def _config_path(path: str | Path, what: str, error: type = BadInput) -> Path:
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.exists() and not p.is_symlink():     # a symlink loop is said as such by read_json_file
        raise error(f"{what} not found (expected a config.json or a folder holding one)", path=p)
    return p


#: the largest config.json read (bytes): public ones are a few KiB (Kimi-K2.5's, with its vision and text configs:
#: tests/data/public_configs/aiconfigurator/moonshotai--Kimi-K2.5_config.json)
MAX_CONFIG_BYTES = 4 * 2 ** 20


def read_config_json(path: str | Path, what: str = "config", *, error: type = BadInput) -> dict:
    """The parsed JSON object of a model's config.json (``path``: the file, or a folder holding one): the one reader
    of config.json files; :func:`read_draft_config` and :func:`read_target_config` build on it.

    Raises:
        ``error`` (:class:`helpers.errors.BadInput` or a subclass), one line naming the file and ``what``: no such
        file, unreadable, not a regular file (a FIFO, a device), over :data:`MAX_CONFIG_BYTES`, empty, not valid
        JSON, nested too deeply, an integer too long to convert (:func:`helpers.runfiles.read_json_file`), or not a
        JSON object.
    """
    p = _config_path(path, what, error)
    d = read_json_file(p, what, error=error, max_bytes=MAX_CONFIG_BYTES)
    if not isinstance(d, dict):
        raise error(f"expected a JSON object, got {type(d).__name__}", path=p)
    return d


def _int_field(d: dict, key: str, path: Path, *, required: bool, positive: bool = True,
               prefix: str = "", minimum: int | None = None, maximum: int | None = None, why: str = "",
               null_ok: bool = True) -> int | None:
    """``d[key]`` as a positive int (None when absent and not required); errors name ``prefix + key`` (the
    sub-config the field was read from, e.g. ``text_config.hidden_size``). ``minimum`` / ``maximum`` (with ``why``,
    the source of the bound) replace the positive check with a closed range; ``null_ok`` False: a present null is an
    error, not an absent field."""
    if key not in d or d[key] is None:
        if required or (key in d and not null_ok):
            raise BadInput("missing required integer field" if key not in d else
                           f"expected an integer {minimum}-{maximum}, got null{why}", path=path, field=prefix + key)
        return None
    v = d[key]
    if minimum is not None or maximum is not None:
        lo, hi = (minimum if minimum is not None else 1), maximum
        if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
            raise BadInput(f"expected an integer {lo}-{hi if hi is not None else 'inf'}, got {_short(v)}{why}",
                           path=path, field=prefix + key)
        return v
    if isinstance(v, bool) or not isinstance(v, int) or (positive and v <= 0):
        raise BadInput(f"expected a positive integer, got {_short(v)}", path=path, field=prefix + key)
    return v


def _short(v: Any, limit: int = 60) -> str:
    """``repr(v)`` cut to ``limit`` characters (a long list in an error line stays one short line)."""
    r = repr(v)
    if len(r) <= limit:
        return r
    return r[:limit] + f"... ({type(v).__name__} of {len(v) if hasattr(v, '__len__') else '?'})"


def _architectures(d: dict, path: Path, prefix: str = "") -> list[str]:
    """``architectures`` as a list of strings ([] when absent or null); SGLang / transformers iterate it as class
    names (``model_config.py`` ``hf_config.architectures``), so a bare string or other items are bad input."""
    archs = d.get("architectures")
    if archs is None:
        return []
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise BadInput(f"expected a list of architecture names (strings), got {archs!r}", path=path,
                       field=prefix + "architectures")
    return list(archs)


def _str_field(d: dict, key: str, path: Path, prefix: str = "") -> str | None:
    v = d.get(key)
    if v is not None and not isinstance(v, str):
        raise BadInput(f"expected a string, got {v!r}", path=path, field=prefix + key)
    return v


#: The most aux layer ids a draft config may list. EAGLE-3 drafts take 3 (SGLang: ``llama_eagle3.py::
#: LlamaForCausalLMEagle3`` fc of ``3 * hidden_size``; vLLM: ``llama_eagle3.py::LlamaModel.__init__``
#: ``num_aux_hidden_states``), and a target has at most a few hundred layers; past this bound a list is a config
#: error, refused before any per-id check (each check is linear in the ids, but their findings are not worth a page).
MAX_LAYER_IDS = 64
#: The largest vocabulary a draft config may give with no ``vocab_size`` to bound its ``draft_vocab_size`` by
#: (released vocabularies stay under 300k tokens)
MAX_VOCAB = 1 << 24


def _ids_field(v: Any, path: Path, key: str) -> tuple[int, ...] | None:
    if v is None:
        return None
    if not isinstance(v, (list, tuple)) or not all(isinstance(i, int) and not isinstance(i, bool) for i in v):
        raise BadInput(f"expected a list of integer layer ids, got {_short(v)}", path=path, field=key)
    if len(v) > MAX_LAYER_IDS:
        raise BadInput(f"expected at most {MAX_LAYER_IDS} layer ids (an EAGLE-3 draft takes 3), got {len(v)}",
                       path=path, field=key)
    return tuple(int(i) for i in v)


def _sub_configs_checked(d: dict, path: Path) -> None:
    """Refuse a text sub-config key (:data:`TEXT_CONFIG_KEYS`) present with a value that is not an object (null
    counts as absent): SGLang / transformers build a config object from it
    (``sglang/srt/utils/hf_transformers/common.py::get_hf_text_config``), so a string there is no sub-config.

    Raises:
        BadInput: one line naming ``path`` and the key."""
    for k in TEXT_CONFIG_KEYS:
        v = d.get(k)
        if v is not None and not isinstance(v, dict):
            raise BadInput(f"expected an object (the text sub-config), got {_short(v)}", path=path, field=k)


def read_mtp_head(raw: dict, path: str | Path) -> MTPHead | None:
    """The MTP / NextN head of a config.json already read (:func:`helpers.layers.mtp.mtp_head`), its fields checked
    first: the layer field (``num_nextn_predict_layers``) an int 0-:data:`helpers.layers.mtp.MAX_MTP_LAYERS` when
    present (absent: the config class's default applies, ``MTPHead.layers_defaulted``; Qwen3.5's top-level copy,
    which vLLM reads first, too), ``num_hidden_layers`` an int 1-:data:`helpers.layers.mtp.MAX_HIDDEN_LAYERS` when
    present (absent: the config class's default, :attr:`helpers.layers.mtp.MTPFamily.hidden_layers_default`, or
    refused where the head's prefix needs it), the sizes the family's layer expansion reads
    (:attr:`helpers.layers.mtp.MTPFamily.size_fields`: ``n_routed_experts`` 1-:data:`helpers.layers.mtp.MAX_EXPERTS`
    ...), non-empty architecture names; all read in the text sub-config where there is one. None: no MTP family.

    Raises:
        BadInput: one line naming ``path`` and the field: a present field of the wrong type (string, null, float,
            list, bool) or out of range (negative, over the bound); ``architectures`` not a list of strings
            (:func:`_architectures`); a text sub-config key (``text_config`` ...) that is not an object."""
    p = Path(path)
    _sub_configs_checked(raw, p)
    archs = _architectures(raw, p)
    if any(not a.strip() for a in archs):
        # SGLang's draft rewrite and vLLM's hf_config_override read architectures[0] as a class name: an empty one is
        # no class (not skipped)
        raise BadInput(f"expected non-empty architecture names, got {archs!r}", path=p, field="architectures")
    fam = family_of(archs)
    if fam is None:
        return None
    tc = mtp_text_config(raw)
    prefix = "" if tc is raw else next(f"{k}." for k, v in raw.items() if v is tc)
    why = " (head layers: SGLang loads 1, vLLM builds one each)"
    _int_field(tc, fam.layers_field, p, required=False, prefix=prefix, minimum=0, maximum=MAX_MTP_LAYERS,
               null_ok=False, why=why)
    if tc is not raw and any("top" in places for _, places in fam.layers_read):
        _int_field(raw, fam.layers_field, p, required=False, minimum=0, maximum=MAX_MTP_LAYERS, null_ok=False,
                   why=why)
    _int_field(tc, "num_hidden_layers", p, required=False, prefix=prefix, minimum=1, maximum=MAX_HIDDEN_LAYERS,
               null_ok=False, why=" (this tool's bound, helpers.layers.mtp.MAX_HIDDEN_LAYERS)")
    if "num_hidden_layers" not in tc and fam.hidden_layers_default is None \
            and fam.prefix_uses_num_hidden_layers():
        raise BadInput(f"missing: the {fam.name} head sits at model.layers.{{num_hidden_layers}}. and the engines' "
                       "config class gives no default to read it from", path=p, field=prefix + "num_hidden_layers")
    for key, lo, hi, null_ok in fam.size_fields:
        _int_field(tc, key, p, required=False, prefix=prefix, minimum=lo, maximum=hi, null_ok=null_ok,
                   why=(" (this tool's bound, helpers.layers.mtp.MAX_EXPERTS: one name per expert is listed)"
                        if key == "n_routed_experts" else ""))
    return mtp_head(raw)


# ------------------------------------------------------------------------------------------------- draft

@dataclass
class DraftConfig:
    """A draft model's config.json, normalised across the three forms.

    Attributes:
        path: the config.json read.
        form: ``"sglang"`` (SGLang/SpecForge ``LlamaForCausalLMEagle3``), ``"eagle"`` (SafeAILab EAGLE-3:
            ``LlamaForCausalLM`` with ``draft_vocab_size``), ``"speculators"`` (``speculators_model_type``) or
            ``"mtp"`` (an MTP / NextN head: a target config of a :data:`helpers.layers.mtp.MTP_FAMILIES` family, or
            a separate NextN checkpoint; :func:`helpers.layers.mtp.mtp_head` says where its layers sit).
        hidden_size: the draft's own hidden size (width of its recurrent state and of ``fc``'s output).
        target_hidden_size: explicit ``target_hidden_size`` (None = SGLang assumes ``hidden_size``).
        num_aux_hidden_states: explicit ``num_aux_hidden_states`` (None if absent).
        vocab_size / draft_vocab_size: target vocab and the draft's (pruned) lm_head vocab.
        nested_layer_ids: ``eagle_config.eagle_aux_hidden_state_layer_ids`` -- the only place SGLang reads ids.
        top_level_layer_ids: a top-level ``eagle_aux_hidden_state_layer_ids`` (speculators / vLLM style),
            which SGLang's capture ignores silently.
        use_aux_hidden_state: ``eagle_config.get("use_aux_hidden_state", True)``.
        raw: the parsed JSON.
    """

    path: Path
    form: str
    architectures: list[str]
    model_type: str | None
    hidden_size: int
    target_hidden_size: int | None
    num_aux_hidden_states: int | None
    vocab_size: int | None
    draft_vocab_size: int | None
    nested_layer_ids: tuple[int, ...] | None
    top_level_layer_ids: tuple[int, ...] | None
    use_aux_hidden_state: bool = True
    fc_norm: bool = False
    norm_before_fc: bool = False
    raw: dict = field(default_factory=dict, repr=False)
    #: a speculators-format draft as vLLM reads it (:class:`helpers.formats.speculators.SpeculatorsDraft`; ``raw``
    #: is then its flat view, ``file_raw`` the config.json as written), None for the other forms
    speculators: Any = field(default=None, repr=False)
    file_raw: dict = field(default_factory=dict, repr=False)

    @property
    def is_eagle3(self) -> bool:
        """True for an EAGLE-3 draft (aux hidden states through ``fc``)."""
        return self.form in ("sglang", "speculators", "eagle")

    @property
    def sglang_num_aux(self) -> int:
        """Number of aux chunks SGLang's draft expects: ``num_aux_hidden_states`` > len(nested ids) > 3.

        Mirrors ``sglang/srt/models/llama_eagle3.py::LlamaModel.__init__`` (0.5.23).
        """
        if self.num_aux_hidden_states is not None:
            return self.num_aux_hidden_states
        if self.nested_layer_ids:
            return len(self.nested_layer_ids)
        return 3

    @property
    def sglang_hidden_size_in(self) -> int:
        """Per-chunk width SGLang's draft assumes: ``target_hidden_size`` if set, else ``hidden_size``."""
        return self.target_hidden_size if self.target_hidden_size is not None else self.hidden_size

    @property
    def sglang_fc_in_features(self) -> int:
        """``fc`` input width SGLang builds: ``sglang_hidden_size_in * sglang_num_aux`` (llama_eagle3.py)."""
        return self.sglang_hidden_size_in * self.sglang_num_aux


def read_draft_config(path: str | Path) -> DraftConfig:
    """Read a draft config.json (file or folder) in SGLang/SpecForge, EAGLE or speculators form.

    Raises:
        BadInput: missing/empty/invalid JSON, not an object, a required field missing or of the wrong type
            (``hidden_size``, ids not a list of ints or more than :data:`MAX_LAYER_IDS`, ``eagle_config`` not an
            object), ``draft_vocab_size`` not in 1..``vocab_size``, an MTP head's layer fields
            (:func:`read_mtp_head`), a speculators flag not true / false
            (:func:`helpers.formats.speculators.vllm_view`).
    """
    p = _config_path(path, "draft config")
    d = read_config_json(p, "draft config")
    archs = _architectures(d, p)
    spec = None
    file_raw = d
    if is_speculators(d):
        form = "speculators"
        spec = vllm_view(d, p)                   # the flat config vLLM builds: transformer_layer_config + eagle3 fields
        tl = d.get("transformer_layer_config") or {}
        hidden = _int_field(tl, "hidden_size", p, required=False) or _int_field(d, "hidden_size", p, required=False)
        if hidden is None:
            raise BadInput("missing hidden_size (looked in transformer_layer_config and at the top level)",
                           path=p, field="transformer_layer_config.hidden_size")
        vocab = _int_field(tl, "vocab_size", p, required=False) or _int_field(d, "vocab_size", p, required=False)
        model_type = _str_field(tl, "model_type", p, "transformer_layer_config.")
        d = {**spec.view, "hidden_size": hidden}        # vLLM's draft hf_config holds these keys only
        if vocab is not None:
            d["vocab_size"] = vocab
    elif family_of(archs) is not None:
        form = "mtp"                  # a target's MTP / NextN head, or a separate NextN checkpoint (layers.mtp)
        read_mtp_head(d, p)
        tc = mtp_text_config(d)
        prefix = "" if tc is d else next(f"{k}." for k, v in d.items() if v is tc)
        hidden = _int_field(tc, "hidden_size", p, required=False)
        if hidden is None:
            raise BadInput("missing hidden_size", path=p, field=prefix + "hidden_size")
        vocab = _int_field(tc, "vocab_size", p, required=False)
        model_type = _str_field(tc, "model_type", p, prefix)
    else:
        form = "sglang" if any("Eagle3" in a for a in archs) or "eagle_config" in d else (
            "eagle" if "draft_vocab_size" in d else "sglang")
        hidden = _int_field(d, "hidden_size", p, required=True)
        vocab = _int_field(d, "vocab_size", p, required=False)
        model_type = _str_field(d, "model_type", p)
    ec = d.get("eagle_config")
    if ec is not None and not isinstance(ec, dict):
        raise BadInput(f"expected an object, got {type(ec).__name__}", path=p, field="eagle_config")
    ec = ec or {}
    nested = _ids_field(ec.get("eagle_aux_hidden_state_layer_ids"), p, "eagle_config.eagle_aux_hidden_state_layer_ids")
    top = _ids_field(d.get("eagle_aux_hidden_state_layer_ids"), p, "eagle_aux_hidden_state_layer_ids")
    use_aux = ec.get("use_aux_hidden_state", True)
    if not isinstance(use_aux, bool):
        raise BadInput(f"expected true/false, got {use_aux!r}", path=p, field="eagle_config.use_aux_hidden_state")
    return DraftConfig(
        path=p, form=form, architectures=[str(a) for a in archs], model_type=model_type, hidden_size=hidden,
        target_hidden_size=_int_field(d, "target_hidden_size", p, required=False),
        num_aux_hidden_states=_int_field(d, "num_aux_hidden_states", p, required=False),
        vocab_size=vocab, draft_vocab_size=_int_field(
            d, "draft_vocab_size", p, required=False, minimum=1, maximum=vocab or MAX_VOCAB,
            why=(f" (at most the vocab_size {vocab}: d2t maps each draft token to a target token)" if vocab else
                 f" (no vocab_size to bound it by; {MAX_VOCAB} is past every released vocabulary)")
            + " -- vLLM builds an lm_head of draft_vocab_size rows (llama_eagle3.py::Eagle3LlamaForCausalLM)"),
        nested_layer_ids=nested, top_level_layer_ids=top, use_aux_hidden_state=use_aux,
        fc_norm=bool(d.get("fc_norm") or d.get("use_aux_norm") or ec.get("fc_norm")),
        norm_before_fc=bool(ec.get("norm_before_fc", d.get("norm_before_fc", False))), raw=d, speculators=spec,
        file_raw=file_raw)


@dataclass
class TensorInfo:
    """One tensor of a safetensors checkpoint: the file holding it, its shape and dtype (from the header)."""

    file: Path
    shape: tuple[int, ...]
    dtype: str


def read_safetensors_index(path: str | Path) -> dict[str, TensorInfo]:
    """Every tensor of a safetensors checkpoint, from the headers only (no tensor data).

    Args:
        path: a folder -- sharded through ``model.safetensors.index.json`` (its ``weight_map`` names the shards,
            as SGLang's loader reads them; each listed key must be in its shard), else its ``*.safetensors`` -- or
            one ``.safetensors`` file.

    Raises:
        BadInput: no safetensors file, an empty or unreadable header, an index naming a missing shard or a key its
            shard does not hold.
    """
    p = Path(path)
    weight_map: dict | None = None
    index = p / "model.safetensors.index.json"
    if p.is_dir() and index.exists():
        doc = read_json_file(index, "safetensors index")
        weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise BadInput("expected a weight_map object {tensor: shard file}", path=index, field="weight_map")
        files = [p / f for f in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise BadInput(f"the index names shard {f.name}, which is not in the folder", path=index)
    else:
        files = sorted(p.glob("*.safetensors")) if p.is_dir() else [p]
    if not files or not all(f.exists() for f in files):
        raise BadInput("no draft weights found (expected *.safetensors or model.safetensors.index.json)", path=p)
    out: dict[str, TensorInfo] = {}
    for f in files:
        if regular_file(f, "safetensors file").stat().st_size == 0:     # a FIFO / device is never opened
            raise BadInput("empty file (expected a safetensors file)", path=f)
        try:
            with safe_open(str(f), framework="pt") as sf:
                for k in sf.keys():
                    sl = sf.get_slice(k)
                    out[k] = TensorInfo(f, tuple(int(x) for x in sl.get_shape()), str(sl.get_dtype()))
        except Exception as e:  # safetensors raises its own error types for corrupt headers
            raise BadInput(f"not a readable safetensors file ({' '.join(str(e).split())[:200]})", path=f) from None
    for k, fname in (weight_map or {}).items():
        if k not in out or out[k].file.name != fname:
            raise BadInput(f"the index maps {k} to {fname}, which does not hold it", path=index, field=k)
    return out


@dataclass
class DraftWeights:
    """What the draft's safetensors say about its wiring (from headers; no weights loaded).

    Attributes:
        files: safetensors files read.
        fc_shape: ``fc.weight`` shape ``[out=H_draft, in=num_aux*H_target]`` (nn.Linear layout), or None.
        fc_key: the tensor name found for fc.
        d2t_shape / t2d_shape: shapes of the vocab maps, None if absent. SGLang uses d2t only
            (``hot_token_id = d2t + arange``; ``llama_eagle3.py::load_weights``), t2d is ignored.
        lm_head_shape: ``lm_head.weight`` shape ``[draft_vocab, H_draft]`` if present.
        tensors: every tensor's file, shape and dtype (:func:`read_safetensors_index`).
    """

    files: list[Path]
    fc_shape: tuple[int, ...] | None
    fc_key: str | None
    d2t_shape: tuple[int, ...] | None
    t2d_shape: tuple[int, ...] | None
    lm_head_shape: tuple[int, ...] | None
    keys: list[str] = field(default_factory=list, repr=False)
    tensors: dict[str, TensorInfo] = field(default_factory=dict, repr=False)


def read_draft_weights(path: str | Path) -> DraftWeights:
    """Read the safetensors header(s) of a draft folder (``*.safetensors``, sharded through
    ``model.safetensors.index.json`` or not) or one file.

    Raises:
        BadInput: as :func:`read_safetensors_index`.
    """

    tensors = read_safetensors_index(path)
    shapes = {k: i.shape for k, i in tensors.items()}
    files = sorted({i.file for i in tensors.values()})

    def find(*names: str) -> str | None:
        for n in names:
            if n in shapes:
                return n
        for k in shapes:
            if any(k.endswith("." + n) for n in names):
                return k
        return None

    fc = find("fc.weight")
    d2t, t2d, lm = find("d2t"), find("t2d"), find("lm_head.weight")
    return DraftWeights(files=files, fc_shape=shapes.get(fc) if fc else None, fc_key=fc,
                        d2t_shape=shapes.get(d2t) if d2t else None, t2d_shape=shapes.get(t2d) if t2d else None,
                        lm_head_shape=shapes.get(lm) if lm else None, keys=sorted(shapes), tensors=tensors)


# ------------------------------------------------------------------------------------------------ target

@dataclass
class TargetConfig:
    """The target model's config.json (text config for multimodal wrappers such as Kimi-K2.5).

    Attributes:
        hidden_size: H, the width of one aux chunk.
        num_hidden_layers: n.
        family: SGLang capture family (:func:`helpers.layers.sglang.target_family`).
        torch_dtype: the checkpoint dtype string (``"bfloat16"``...), None if absent.
    """

    path: Path | None
    architectures: list[str]
    model_type: str | None
    hidden_size: int
    num_hidden_layers: int
    vocab_size: int | None
    torch_dtype: str | None = None
    raw: dict = field(default_factory=dict, repr=False)
    fields: dict = field(default_factory=dict)   # which config field each value came from (aliases, sub-config)

    @property
    def family(self) -> str:
        return target_family(self.architectures, self.model_type)


#: SGLang's text sub-config keys, most preferred first (``sglang/srt/utils/hf_transformers/common.py::
#: get_hf_text_config``: thinker_config > llm_config > language_config > text_config).
TEXT_CONFIG_KEYS = ("thinker_config", "llm_config", "language_config", "text_config")
#: field aliases the config classes SGLang / transformers use map onto the standard names
#: (``sglang/srt/configs/longcat_flash.py`` num_layers, ``chatglm.py`` / ``exaone.py`` ``attribute_map``
#: num_layers, ``dbrx.py`` n_layers / d_model, transformers ``GPT2Config`` n_layer / n_embd).
FIELD_ALIASES = {"num_hidden_layers": ("num_layers", "n_layers", "n_layer"),
                 "hidden_size": ("d_model", "n_embd")}


def _aliased(src: dict, key: str, path: Path, prefix: str) -> tuple[int | None, str]:
    """(value, the field name it came from) for ``key`` or one of its aliases."""
    for name in (key,) + FIELD_ALIASES.get(key, ()):
        v = _int_field(src, name, path, required=False, prefix=prefix)
        if v is not None:
            return v, prefix + name
    return None, prefix + key


def read_target_config(path: str | Path) -> TargetConfig:
    """Read a target config.json (file or folder) the way SGLang reads it: the text sub-config when there is one
    (:data:`TEXT_CONFIG_KEYS`, e.g. ``KimiK25ForConditionalGeneration``'s ``text_config``), and the field
    aliases of :data:`FIELD_ALIASES` (e.g. LongCat-Flash's ``num_layers``).

    Raises:
        BadInput: missing/invalid JSON, or ``hidden_size`` / ``num_hidden_layers`` (nor an alias) missing or not
            positive ints (the message names the field and the sub-config looked in).
    """
    p = _config_path(path, "target config")
    d = read_config_json(p, "target config")
    _sub_configs_checked(d, p)
    sub_key = next((k for k in TEXT_CONFIG_KEYS if isinstance(d.get(k), dict)), None)
    tc = d[sub_key] if sub_key else {}
    src, prefix = (tc, f"{sub_key}.") if sub_key else (d, "")
    hidden, hname = _aliased(src, "hidden_size", p, prefix)
    layers, lname = _aliased(src, "num_hidden_layers", p, prefix)
    if sub_key and (hidden is None or layers is None):   # a wrapper that keeps them at the top level
        h2, _ = _aliased(d, "hidden_size", p, "")
        l2, _ = _aliased(d, "num_hidden_layers", p, "")
        hidden, layers = hidden or h2, layers or l2
    if hidden is None:
        raise BadInput("missing required integer field (nor d_model / n_embd)", path=p, field=prefix + "hidden_size")
    if layers is None:
        raise BadInput("missing required integer field (nor num_layers / n_layers / n_layer)", path=p,
                       field=prefix + "num_hidden_layers")
    archs = _architectures(d, p)
    model_type = _str_field(d, "model_type", p)
    dtype = d.get("torch_dtype") or d.get("dtype") or tc.get("torch_dtype") or tc.get("dtype")
    return TargetConfig(path=p, architectures=archs, model_type=model_type,
                        hidden_size=hidden, num_hidden_layers=layers,
                        vocab_size=_int_field(src, "vocab_size", p, required=False, prefix=prefix) or
                        _int_field(d, "vocab_size", p, required=False),
                        torch_dtype=str(dtype) if dtype else None, raw=d, fields={"hidden_size": hname,
                                                                                 "num_hidden_layers": lname})


#: config fields naming the routed experts of a MoE model (DeepSeek / Kimi, Mixtral, Qwen-MoE / OLMoE)
EXPERT_FIELDS = ("n_routed_experts", "num_local_experts", "num_experts")


def _pos_int(d: dict, key: str) -> int | None:
    v = d.get(key)
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


def describe_architecture(path: str | Path) -> str:
    """One line naming a model's architecture from its config.json (file or folder; a wrapper's text sub-config as
    SGLang reads it), e.g. ``DeepseekV3ForCausalLM: MLA attention (8 heads, q_lora_rank 64, kv_lora_rank 64), MoE (8
    routed experts, top-2, 1 shared; first 1 layer dense), 8 layers, hidden 128`` or ``LlamaForCausalLM: attention
    (8 heads, 8 KV heads), dense MLP, 8 layers, hidden 128``. Attention is MLA when the config has ``kv_lora_rank``
    (DeepSeek-V2/V3, Kimi-K2); MoE when it names routed experts (:data:`EXPERT_FIELDS`).

    Raises:
        BadInput: the config.json is missing or not a JSON object (:func:`read_config_json`).
    """
    p = _config_path(path, "model config")
    d = read_config_json(p, "model config")
    sub = next((d[k] for k in TEXT_CONFIG_KEYS if isinstance(d.get(k), dict)), None)
    src = {**d, **sub} if sub else d
    archs = _architectures(d, p) or [str(src.get("model_type") or "unknown architecture")]
    heads = _pos_int(src, "num_attention_heads")
    kv = _pos_int(src, "num_key_value_heads")
    if _pos_int(src, "kv_lora_rank"):
        inner = [f"{heads} heads"] if heads else []
        inner += [f"q_lora_rank {src['q_lora_rank']}"] if _pos_int(src, "q_lora_rank") else []
        inner.append(f"kv_lora_rank {src['kv_lora_rank']}")
        attn = f"MLA attention ({', '.join(inner)})"
    else:
        inner = ([f"{heads} heads"] if heads else []) + ([f"{kv} KV heads"] if kv else [])
        attn = "attention" + (f" ({', '.join(inner)})" if inner else "")
    experts = next((_pos_int(src, k) for k in EXPERT_FIELDS if _pos_int(src, k)), None)
    layers = next((_pos_int(src, k) for k in ("num_hidden_layers",) + FIELD_ALIASES["num_hidden_layers"]
                   if _pos_int(src, k)), None)
    dense = _pos_int(src, "first_k_dense_replace")
    if experts and dense and layers and dense >= layers:      # e.g. the MLA draft: one layer, first_k_dense_replace 1
        mlp = f"dense MLP (every layer below first_k_dense_replace {dense}; the MoE fields are unused)"
    elif experts:
        inner = [f"{experts} routed experts"]
        inner += [f"top-{src['num_experts_per_tok']}"] if _pos_int(src, "num_experts_per_tok") else []
        inner += [f"{src['n_shared_experts']} shared"] if _pos_int(src, "n_shared_experts") else []
        mlp = f"MoE ({', '.join(inner)}" + (f"; first {dense} layer{'s' if dense > 1 else ''} dense" if dense else "") \
            + ")"
    else:
        mlp = "dense MLP"
    hidden = next((_pos_int(src, k) for k in ("hidden_size",) + FIELD_ALIASES["hidden_size"] if _pos_int(src, k)),
                  None)
    tail = ([f"{layers} layer{'s' if layers > 1 else ''}"] if layers else []) + ([f"hidden {hidden}"] if hidden else [])
    return f"{archs[0]}: " + ", ".join([attn, mlp] + tail)
