"""MoE routing ops of SGLang's CPU engine, in plain torch.

``biased_grouped_topk_cpu`` is the router of DeepSeek-V3-class models (``topk_method: noaux_tc``, sigmoid scores with
an ``e_score_correction_bias``). SGLang 0.5.23 calls it on the CPU AMX path whatever the dtype
(``sglang/srt/layers/moe/topk.py::biased_grouped_topk_cpu``, selected at module level when ``_is_cpu and
_is_cpu_amx_available``), with ``routed_scaling_factor`` only when the scaling is applied on the router's output and
``num_token_non_padded=None`` by keyword.

Semantics: those of the kernel's own reference, ``sglang/srt/layers/moe/topk.py::biased_grouped_topk_impl`` (what
SGLang's CPU kernel test compares ``torch.ops.sgl_kernel.biased_grouped_topk_cpu`` with, the routed scaling factor
multiplied on when given), which equal HF transformers' ``DeepseekV3MoE.route_tokens_to_experts`` routing.
"""
from __future__ import annotations

from typing import Optional

import torch

#: the renormalisation's epsilon (``sglang/srt/layers/moe/topk.py::_RENORMALIZE_SUM_EPSILON``; HF adds 1e-20 too)
RENORMALIZE_EPS = 1e-20


def biased_grouped_topk_cpu(hidden_states: torch.Tensor, gating_output: torch.Tensor,
                            correction_bias: torch.Tensor, topk: int, renormalize: bool,
                            num_expert_group: Optional[int], topk_group: Optional[int],
                            num_fused_shared_experts: int = 0, routed_scaling_factor: Optional[float] = None,
                            num_token_non_padded: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Grouped top-k over sigmoid scores with a selection bias (DeepSeek-V3 ``noaux_tc``).

    For each token: ``s = sigmoid(gating_output)`` (float32); ``c = s + correction_bias``; a group's score is the sum
    of its two largest ``c``; the ``topk_group`` best groups stay selectable; the experts are the ``topk`` largest
    ``c`` among them; their weights are ``s`` (not ``c``) at those experts, divided by their sum (+1e-20) when
    ``renormalize``, times ``routed_scaling_factor`` when given.

    Args:
        hidden_states: ``[T, H]`` (only its row count is used).
        gating_output: router logits ``[T, E]``, any float dtype (computed in float32).
        correction_bias: ``[E]`` selection bias (``e_score_correction_bias``).
        topk: experts per token; num_expert_group / topk_group: groups and groups kept (None: 1).
        num_fused_shared_experts: must be 0 (shared-expert fusion is off on this path: SGLang disables it unless
            ``n_routed_experts`` is 256 or 384, ``deepseek_v2.py::shared_experts_fusion_disable_reason``).
        routed_scaling_factor: multiplied on the weights when not None.
        num_token_non_padded: must be None (SGLang passes None: "not supported in kernel").

    Returns:
        ``(topk_weights [T, topk] float32, topk_ids [T, topk] int32)``.

    Raises:
        NotImplementedError: fused shared experts or ``num_token_non_padded`` given.
        ValueError: experts not divisible by groups, ``topk`` or ``topk_group`` out of range.
    """
    if num_fused_shared_experts:
        raise NotImplementedError("sgl_kernel stand-in biased_grouped_topk_cpu: fused shared experts are not "
                                  "supported (SGLang's CPU path runs the shared expert separately)")
    if num_token_non_padded is not None:
        raise NotImplementedError("sgl_kernel stand-in biased_grouped_topk_cpu: num_token_non_padded must be None")
    if hidden_states.shape[0] != gating_output.shape[0]:
        raise ValueError(f"biased_grouped_topk_cpu: {hidden_states.shape[0]} tokens but {gating_output.shape[0]} "
                         "rows of router logits")
    t, e = gating_output.shape
    groups = int(num_expert_group or 1)
    keep = int(topk_group or 1)
    if e % groups or not 1 <= keep <= groups or not 1 <= topk <= e:
        raise ValueError(f"biased_grouped_topk_cpu: {e} experts, {groups} groups, topk_group {keep}, topk {topk}")
    scores = gating_output.float().sigmoid()
    choice = scores + correction_bias.float().view(1, e)
    per_group = choice.view(t, groups, e // groups)
    group_score = per_group.topk(min(2, e // groups), dim=-1).values.sum(dim=-1)          # [T, G]
    kept = torch.zeros_like(group_score, dtype=torch.bool)
    kept.scatter_(1, group_score.topk(keep, dim=-1).indices, True)
    masked = choice.masked_fill(~kept.repeat_interleave(e // groups, dim=1), float("-inf"))
    ids = masked.topk(topk, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + RENORMALIZE_EPS)
    if routed_scaling_factor is not None:
        weights = weights * routed_scaling_factor
    return weights.to(torch.float32), ids.to(torch.int32)
