"""``sgl_kernel`` stand-in: SGLang's CPU kernels, reimplemented in plain torch for tests and laptops.

SGLang 0.5.23 with ``SGLANG_USE_CPU_ENGINE=1`` imports ``sgl_kernel`` unconditionally, and its
EAGLE path needs the ``intel_amx`` attention backend, whose kernels live in the CPU build of
``sgl_kernel`` (C++/AMX, source only in the SGLang repository, no wheel). This package provides:

* the ~20 ops the Llama + EAGLE-3 path calls (``layers``, ``attention``, ``speculative``,
  ``comm``) and the DeepSeek-V3 router (``moe``), registered as ``torch.ops.sgl_kernel.<op>`` or exported as Python functions exactly
  where SGLang expects them;
* for every other name SGLang imports, a stub that raises ``NotImplementedError`` naming the op
  when called (importing it is harmless, as SGLang imports far more than it calls).

It executes no AMX instruction: ``env/reference/standin/e3f_boot.py`` makes SGLang's AMX
capability probe answer yes (so SGLang selects its intel_amx code path), and every kernel on that
path is the torch code here. See env/reference/README.md.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import types

from . import attention, comm, layers, moe, speculative
from ._dispatch import define, define_stub, not_implemented, trace

__version__ = "0.0.0+e3f.standin"
STANDIN = True

# --- dispatcher ops (torch.ops.sgl_kernel.*) -------------------------------------------------
define("rmsnorm_cpu(Tensor input, Tensor weight, float eps) -> Tensor", layers.rmsnorm_cpu)
define("fused_add_rmsnorm_cpu(Tensor(a!) input, Tensor(b!) residual, Tensor weight, float eps) -> ()",
       layers.fused_add_rmsnorm_cpu)
define("silu_and_mul_cpu(Tensor input) -> Tensor", layers.silu_and_mul_cpu)
define("rotary_embedding_cpu(Tensor positions, Tensor(a!) query, Tensor(b!) key, int head_size, "
       "Tensor cos_sin_cache, bool is_neox) -> (Tensor, Tensor)", layers.rotary_embedding_cpu)
define("convert_weight_packed(Tensor weight) -> Tensor", layers.convert_weight_packed)
define("weight_packed_linear(Tensor mat1, Tensor mat2, Tensor? bias, bool is_vnni) -> Tensor",
       layers.weight_packed_linear)
define("store_cache_cpu(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor indices, "
       "int row_dim) -> ()", attention.store_cache_cpu)
define("decode_attention_cpu(Tensor query, Tensor(a!) k_cache, Tensor(b!) v_cache, float k_scale, "
       "float v_scale, Tensor(c!) output, Tensor? key, Tensor? value, Tensor loc, Tensor attn_logits, "
       "Tensor req_to_token, Tensor req_pool_indices, Tensor seq_lens, float sm_scale, "
       "float logit_cap, bool is_cross_attn=False, int sliding_window=0, Tensor? encoder_lens=None, "
       "Tensor? sinks=None) -> ()", attention.decode_attention_cpu)
define("extend_attention_cpu(Tensor q_extend, Tensor k_extend, Tensor v_extend, Tensor(a!) o_extend, "
       "Tensor k_buffer, Tensor v_buffer, float k_scale, float v_scale, Tensor req_to_token, "
       "Tensor req_pool_indices, Tensor seq_lens, Tensor extend_seq_lens, Tensor extend_start_loc, "
       "int? max_len_extend, float sm_scale, float logit_cap, bool is_cross_attn=False, "
       "int sliding_window=0, Tensor? encoder_lens=None, Tensor? sinks=None, Tensor? tree_mask=None, "
       "bool is_causal=True) -> ()", attention.extend_attention_cpu)
define("biased_grouped_topk_cpu(Tensor hidden_states, Tensor gating_output, Tensor correction_bias, int topk, "
       "bool renormalize, int? num_expert_group, int? topk_group, int num_fused_shared_experts=0, "
       "float? routed_scaling_factor=None, Tensor? num_token_non_padded=None) -> (Tensor, Tensor)",
       moe.biased_grouped_topk_cpu)
define("shm_allreduce(Tensor(a!) data, int reduce_op) -> ()", comm.shm_allreduce)
define("shm_allgather(Tensor data, int dim) -> Tensor", comm.shm_allgather)
define("init_cpu_threads_env(str cpu_ids) -> str", comm.init_cpu_threads_env)
define("initialize(int size, int rank) -> ()", comm.initialize)

# Referenced at import time by SGLang modules on the covered path, never called on it.
define_stub("apply_rotary_pos_emb_cpu(Tensor query, Tensor key, Tensor cos, Tensor sin) -> (Tensor, Tensor)")
# Found by walking SGLang 0.5.23's module-level code for ``torch.ops.sgl_kernel.<name>``
# (vision, conv, grok, qwen3_5, muse_glimmer, gdn); defining them makes no hasattr() probe flip.
for _name in ("flash_attn_varlen_func", "conv3d_embed_cpu", "fused_dual_residual_rmsnorm_cpu",
              "fused_gdn_gating_cpu", "fused_moe_router_cpu", "fused_qk_gemma_rmsnorm_cpu",
              "fused_qk_gemma_rmsnorm_with_gate_cpu", "fused_qkvzba_split_reshape_cat_contiguous_cpu",
              "fused_sigmoid_gating_delta_rule_update_cpu", "fused_sigmoid_mul_cpu"):
    define_stub(f"{_name}(Tensor[] args) -> Tensor[]")

# --- Python-level functions (``from sgl_kernel import ...``) -----------------------------------
assign_req_to_token_pool_cpu = trace("assign_req_to_token_pool_cpu",
                                     speculative.assign_req_to_token_pool_cpu)
assign_extend_cache_locs_cpu = trace("assign_extend_cache_locs_cpu",
                                     speculative.assign_extend_cache_locs_cpu)
assign_draft_cache_locs_contiguous_cpu = trace("assign_draft_cache_locs_contiguous_cpu",
                                               speculative.assign_draft_cache_locs_contiguous_cpu)
build_draft_decode_metadata_cpu = trace("build_draft_decode_metadata_cpu",
                                        speculative.build_draft_decode_metadata_cpu)
build_tree_kernel_efficient_cpu = trace("build_tree_kernel_efficient_cpu",
                                        speculative.build_tree_kernel_efficient_cpu)
verify_tree_greedy_cpu = trace("verify_tree_greedy_cpu", speculative.verify_tree_greedy_cpu)
fill_bonus_tokens_cpu = trace("fill_bonus_tokens_cpu", speculative.fill_bonus_tokens_cpu)
fill_accept_out_cache_loc_cpu = trace("fill_accept_out_cache_loc_cpu",
                                      speculative.fill_accept_out_cache_loc_cpu)
copy_all_layer_kv_cache_cpu = trace("copy_all_layer_kv_cache_cpu",
                                    speculative.copy_all_layer_kv_cache_cpu)


# --- everything else: importable, raises NotImplementedError when used -------------------------
class _Stub:
    """Placeholder for an SGLang kernel outside the covered path (call -> NotImplementedError)."""

    def __init__(self, name: str):
        self._name = name

    def __call__(self, *args, **kwargs):
        return not_implemented(self._name)(*args, **kwargs)

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Stub(f"{self._name}.{attr}")

    def __repr__(self) -> str:
        return f"<sgl_kernel stand-in stub {self._name}>"


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return _Stub(name)


class _StubSubmodules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves ``sgl_kernel.<sub>`` imports that have no file here as stub modules."""

    def find_spec(self, fullname, path, target=None):
        if not fullname.startswith(__name__ + "."):
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec):
        mod = types.ModuleType(spec.name)
        mod.__path__ = []
        prefix = spec.name

        def _getattr(attr, _prefix=prefix):
            if attr.startswith("__"):
                raise AttributeError(attr)
            return _Stub(f"{_prefix}.{attr}")

        mod.__getattr__ = _getattr
        return mod

    def exec_module(self, module):
        return None


if not any(isinstance(f, _StubSubmodules) for f in sys.meta_path):
    sys.meta_path.append(_StubSubmodules())

if os.environ.get("E3F_STANDIN_VERBOSE") == "1":
    print(f"[sgl_kernel stand-in] loaded in pid {os.getpid()}", file=sys.stderr)
