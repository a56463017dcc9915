"""Load an MLA EAGLE-3 draft folder with SGLang 0.5.23's own ``Eagle3DeepseekV2ForCausalLM``, in the SGLang venv.

Usage (env/reference/.venv/bin/python, SGLANG_USE_CPU_ENGINE=1, PYTHONPATH with env/reference/standin):
``sglang_mla_draft_load.py DRAFT_DIR OUT.pt [NAME=DIR[:draft] ...] [nextn:NAME=DIR ...]``. Each ``NAME=DIR`` is also parsed with SGLang's
``ModelConfig`` (``:draft``: ``is_draft_model=True``) into OUT.pt's ``configs[NAME]`` (architectures, layers,
attention arch, ``num_nextn_predict_layers``, MLA scaling, context length, eagle_config, draft vocab, tie,
rope_parameters, topk_method, moe_layer_freq), so one SGLang import serves both checks. Each ``nextn:NAME=DIR`` is
loaded with SGLang's own NextN draft module (:func:`load_nextn`) into OUT.pt's ``nextn[NAME]``. Builds the model from the folder's config.json as SGLang's draft
worker does (``ModelConfig(..., is_draft_model=True)``, fp32 default dtype, TP 1 on a world-1 gloo group bound to
127.0.0.1: ``sglang/test/layer_ut_utils.py::init_single_process_dist``), feeds the checkpoint through its own
``load_weights`` (name mapping, q_a / kv_a fusion, gate / up stacking, ``post_load_weights``' w_kc / w_vc split,
``hot_token_id``), then writes OUT.pt: ``params`` (every named parameter, fp32), ``w_kc``, ``w_vc``,
``hot_token_id``, ``scaling`` (the MLA softmax scale), ``cos_sin`` (the rotary cos/sin cache, first 64 positions),
``is_neox_style``, ``uninitialised`` (parameter names no checkpoint tensor was written to). No forward pass (that
needs a running server's batch); the test compares these with the trainer module.
"""
import os
import socket
import sys

import torch
from safetensors.torch import load_file


def config_facts(path: str, draft: bool) -> dict:
    """What SGLang's own config path (configs/model_config.py::ModelConfig) makes of a model folder."""
    from sglang.srt.configs.model_config import ModelConfig
    m = ModelConfig(path, dtype="float32", is_draft_model=draft)
    c = m.hf_config
    return dict(arch=list(c.architectures), layers=m.num_hidden_layers, mla=m.attention_arch.name,
                nextn=m.num_nextn_predict_layers, scaling=getattr(m, "scaling", None), ctx=m.context_len,
                eagle=getattr(c, "eagle_config", None), draft_vocab=getattr(c, "draft_vocab_size", None),
                tie=c.tie_word_embeddings, rope=dict(getattr(c, "rope_parameters", None) or {}),
                topk=getattr(c, "topk_method", None), freq=getattr(c, "moe_layer_freq", None))


def init_single_process() -> None:
    """A world-1 gloo group bound to 127.0.0.1 with SGLang's runtime context published (TP 1, CPU), as
    ``sglang/test/layer_ut_utils.py::init_single_process_dist`` and ``test_utils.py::publish_build_topology`` do
    (inlined: sglang.test.test_utils imports benchmark modules that need `datasets`, not installed here)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    from sglang.srt.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
    from sglang.srt.runtime_context import SpawnRanks, publish, reset_context
    from sglang.srt.server_args import ServerArgs
    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo")
    reset_context()
    publish(ServerArgs(model_path="dummy", tp_size=1, ep_size=1, pp_size=1, device="cpu"), role="test",
            ranks=SpawnRanks(world_rank=0))
    from sglang.srt.distributed import parallel_state
    from sglang.srt.runtime_context import get_parallel
    get_parallel().override_permanently(world_group=parallel_state._WORLD)
    initialize_model_parallel(backend="gloo")


def build_loaded(draft_dir: str, dtype: str = "float32"):
    """SGLang's own ``Eagle3DeepseekV2ForCausalLM`` built from ``draft_dir``'s config as the draft worker builds it
    (``ModelConfig(..., is_draft_model=True)``, parameters in ``dtype``), every parameter first filled with NaN, then
    the checkpoint fed through its own ``load_weights``."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.models.kimi_k25_eagle3 import Eagle3DeepseekV2ForCausalLM
    cfg = ModelConfig(draft_dir, dtype=dtype, is_draft_model=True).hf_config
    torch.set_default_dtype(getattr(torch, dtype))
    model = Eagle3DeepseekV2ForCausalLM(cfg)
    torch.set_default_dtype(torch.float32)
    for p in model.parameters():
        p.data.fill_(float("nan"))
    model.load_weights(iter(load_file(os.path.join(draft_dir, "model.safetensors")).items()))
    return model


def load_nextn(folder: str) -> dict:
    """SGLang's own NextN draft (``sglang/srt/models/deepseek_nextn.py::DeepseekV3ForCausalLMNextN``) built from
    ``folder``'s config as the draft worker builds it (``ModelConfig(..., is_draft_model=True)`` renames a
    ``DeepseekV3ForCausalLM`` target to the NextN class), every parameter NaN-filled, then every ``*.safetensors``
    tensor of the folder fed through its ``load_weights`` (``deepseek_weight_loader.py::do_load_weights`` with
    ``is_nextn=True``: the extra layer ``model.layers.{N}.*`` mapped, everything else skipped). Returns the
    architecture, ``params`` (fp32) and ``uninitialised`` (names still all NaN)."""
    import glob

    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.models.deepseek_nextn import DeepseekV3ForCausalLMNextN
    cfg = ModelConfig(folder, dtype="float32", is_draft_model=True).hf_config
    model = DeepseekV3ForCausalLMNextN(cfg)
    for p in model.parameters():
        p.data.fill_(float("nan"))
    weights = {}
    for f in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
        weights.update(load_file(f))
    model.load_weights(iter(weights.items()))
    params = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    return {"arch": list(cfg.architectures), "params": params,
            "uninitialised": sorted(n for n, p in params.items() if torch.isnan(p).all())}


def main(draft_dir: str, out: str, *configs: str) -> None:
    init_single_process()
    facts, nextn = {}, {}
    for spec in configs:
        name, path = spec.split("=", 1)
        if name.startswith("nextn:"):        # nextn:NAME=DIR: load DIR's NextN layer with SGLang's own module
            nextn[name.removeprefix("nextn:")] = load_nextn(path)
            continue
        draft = path.endswith(":draft")
        facts[name] = config_facts(path.removesuffix(":draft"), draft)
    model = build_loaded(draft_dir)
    attn = model.model.midlayer.self_attn
    params = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    rot = attn.rotary_emb
    torch.save({
        "params": params,
        "uninitialised": sorted(n for n, p in params.items() if torch.isnan(p).all()),
        "w_kc": attn.w_kc.detach().float().clone(), "w_vc": attn.w_vc.detach().float().clone(),
        "hot_token_id": model.hot_token_id.clone(),
        "scaling": float(attn.scaling),
        "cos_sin": rot.cos_sin_cache[:64].detach().float().clone(),
        "is_neox_style": bool(rot.is_neox_style),
        "rope_class": type(rot).__name__,
        "fc_norm": model.model.fc_norm is not None,
        "num_aux_hidden_states": int(model.model.num_aux_hidden_states),
        "configs": facts,
        "nextn": nextn,
    }, out)


if __name__ == "__main__":
    main(*sys.argv[1:])
