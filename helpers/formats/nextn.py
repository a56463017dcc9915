"""The separate NextN / MTP checkpoint of a DeepSeek-V3-class target, built from the target's extra layer.

DeepSeek-V3 ships its multi-token-prediction module inside the target checkpoint as the extra decoder layer
``model.layers.{num_hidden_layers}.*`` (config ``num_nextn_predict_layers: 1``). SGLang serves it from there
(``--speculative-algorithm NEXTN`` with no draft path: ``arg_groups/speculative_hook.py::handle_speculative_decoding``
sets the draft path to the target's for ``DeepseekV3ForCausalLM``) or from a separate folder that SGLang's
``scripts/export_deepseek_nextn.py`` writes. :func:`export_nextn` writes that folder.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from ..errors import BadInput

NEXTN_ARCH = "DeepseekV3ForCausalLMNextN"
NEXTN_FILE = "nextn_layer_parameters.safetensors"
# tensors of the extra layer that the separate checkpoint leaves out: SGLang shares the target's
# (deepseek_common/deepseek_weight_loader.py::do_load_weights skips them; set_embed_and_head)
SHARED = ("embed_tokens", "shared_head.head")


def _target_files(target_dir: Path) -> list[Path]:
    files = sorted(target_dir.glob("*.safetensors"))
    if not files:
        raise BadInput("no *.safetensors file (expected the target's checkpoint)", path=target_dir)
    return files


def export_nextn(target_dir, out_dir) -> dict:
    """Write the NextN layer of a DeepSeek-V3-class target as a separate NextN checkpoint.

    Mirrors SGLang's ``scripts/export_deepseek_nextn.py`` (sgl-project/sglang, ``update_and_save_config``,
    ``copy_non_safetensors_files``, ``export_nextn_layer_parameters``): ``out_dir`` gets the target's
    non-safetensors files (tokenizer, generation config...), a config.json with ``num_hidden_layers: 1`` and
    ``architectures: ["DeepseekV3ForCausalLMNextN"]`` (every other field the target's), the tensors
    ``model.layers.{N}.*`` (N = the target's ``num_hidden_layers``) renamed ``model.layers.0.*`` without
    ``embed_tokens`` / ``shared_head.head`` in ``nextn_layer_parameters.safetensors`` (dtypes kept: bf16, the
    gate's ``e_score_correction_bias`` fp32), and ``model.safetensors.index.json`` mapping each to that file.
    SGLang loads it as a draft: ``deepseek_weight_loader.py::_initialize_nextn_conf`` takes layer id 0 when
    ``num_hidden_layers == 1``.

    Args:
        target_dir: the target folder (config.json with ``num_nextn_predict_layers`` 1, ``*.safetensors``).
        out_dir: created if absent; existing files of the same names are overwritten.
    Returns:
        ``{"layer_id": N, "tensors": count, "path": out_dir}``.
    Raises:
        BadInput: config.json missing / without ``num_hidden_layers`` / ``num_nextn_predict_layers`` != 1, or
        no tensor ``model.layers.{N}.*`` in the target's safetensors (the NextN weights are missing).
    """
    from safetensors import safe_open  # lazy: torch (the formats package is read by light entry points)
    from safetensors.torch import save_file  # lazy: torch

    target_dir, out_dir = Path(target_dir), Path(out_dir)
    cfg_path = target_dir / "config.json"
    if not cfg_path.is_file():
        raise BadInput("missing (expected the target's config.json)", path=cfg_path)
    cfg = json.loads(cfg_path.read_text())
    n = cfg.get("num_hidden_layers")
    if not isinstance(n, int) or n < 1:
        raise BadInput(f"expected a positive integer, got {n!r}", path=cfg_path, field="num_hidden_layers")
    if cfg.get("num_nextn_predict_layers") != 1:
        raise BadInput(f"expected 1 (SGLang's NextN loader supports one layer), got "
                       f"{cfg.get('num_nextn_predict_layers')!r}", path=cfg_path, field="num_nextn_predict_layers")
    prefix = f"model.layers.{n}."
    params = {}
    for f in _target_files(target_dir):
        with safe_open(str(f), framework="pt") as sf:
            for k in sf.keys():
                if k.startswith(prefix) and not any(s in k for s in SHARED):
                    params["model.layers.0." + k[len(prefix):]] = sf.get_tensor(k)
    if not params:
        raise BadInput(f"no tensor {prefix}* (the NextN layer is not in this checkpoint)", path=target_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for f in target_dir.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
            shutil.copy2(f, out_dir / f.name)
    (out_dir / "config.json").write_text(json.dumps(
        {**cfg, "num_hidden_layers": 1, "architectures": [NEXTN_ARCH]}, indent=2, sort_keys=True) + "\n")
    save_file(params, str(out_dir / NEXTN_FILE), metadata={"format": "pt"})
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: NEXTN_FILE for k in sorted(params)}}, indent=2) + "\n")
    return {"layer_id": n, "tensors": len(params), "path": str(out_dir)}
