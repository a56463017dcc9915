"""Dense-layer ops of SGLang's CPU (intel_amx) path, in plain torch.

Each function mirrors the PyTorch-native reference that SGLang itself falls back to when the C++
kernel is absent; the file and function are named in each docstring. Computation is done in
float32 and cast back to the input dtype, as the reference does.
"""
from __future__ import annotations

from typing import Optional

import torch


def rmsnorm_cpu(input: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm: ``(x / sqrt(mean(x^2) + eps)) * weight``.

    Args: input ``[T, H]`` (any float dtype), weight ``[H]``, eps.
    Returns a new ``[T, H]`` tensor of ``input.dtype``.
    Mirrors ``sglang/srt/layers/layernorm.py::RMSNorm.forward_native`` (cast_x_before_out_mul=False).
    """
    x = input.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (x * weight.to(torch.float32)).to(input.dtype)


def fused_add_rmsnorm_cpu(input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                          eps: float) -> None:
    """In place: ``residual <- input + residual``; ``input <- rmsnorm(residual)``.

    Args: input, residual ``[T, H]`` (same dtype; both mutated), weight ``[H]``.
    Mirrors ``sglang/srt/layers/layernorm.py::RMSNorm.forward_native`` with a residual: the sum is
    taken in float32, stored to ``residual`` in its dtype, and normalised from the float32 sum.
    """
    x = input.to(torch.float32) + residual.to(torch.float32)
    residual.copy_(x.to(residual.dtype))
    x = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)
    input.copy_((x * weight.to(torch.float32)).to(input.dtype))


def silu_and_mul_cpu(input: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :d]) * x[..., d:]`` with ``d = x.shape[-1] // 2``.

    Args: input ``[..., 2d]``. Returns ``[..., d]`` of ``input.dtype``.
    Mirrors ``sglang/srt/layers/activation.py::SiluAndMul.forward_native``.
    """
    d = input.shape[-1] // 2
    return torch.nn.functional.silu(input[..., :d]) * input[..., d:]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox: bool) -> torch.Tensor:
    # x: [T, heads, rot_dim]; cos/sin: [T, rot_dim // 2]
    cos = cos.unsqueeze(-2)
    sin = sin.unsqueeze(-2)
    if is_neox:
        x1, x2 = torch.chunk(x, 2, dim=-1)
    else:
        x1, x2 = x[..., ::2], x[..., 1::2]
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    if is_neox:
        return torch.cat((o1, o2), dim=-1)
    return torch.stack((o1, o2), dim=-1).flatten(-2)


def rotary_embedding_cpu(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                         head_size: int, cos_sin_cache: torch.Tensor,
                         is_neox: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary position embedding on the first ``rotary_dim`` channels of each head.

    Args: positions ``[T]`` int; query ``[T, Hq*D]`` or ``[T, Hq, D]``; key likewise with Hkv;
    cos_sin_cache ``[max_pos, rotary_dim]`` (cos half then sin half); is_neox selects
    rotate-half (NeoX/Llama) vs interleaved (GPT-J) pairing.
    Returns new (query, key) tensors of the input shapes; like the C++ kernel, 2-D inputs are
    also updated in place.
    Mirrors ``sglang/srt/layers/rotary_embedding/base.py::RotaryEmbedding.forward_native``.
    """
    positions = positions.flatten()
    t = positions.shape[0]
    cos_sin = cos_sin_cache.index_select(0, positions.to(torch.long)).to(torch.float32)
    cos, sin = cos_sin.chunk(2, dim=-1)
    rot = cos_sin_cache.shape[-1]
    outs = []
    for x in (query, key):
        xv = x.reshape(t, -1, head_size).to(torch.float32)
        rotated = _rotate(xv[..., :rot], cos, sin, is_neox)
        y = torch.cat((rotated, xv[..., rot:]), dim=-1).to(x.dtype).reshape(x.shape)
        if x.dim() == 2:
            x.copy_(y)
        outs.append(y)
    return outs[0], outs[1]


def convert_weight_packed(weight: torch.Tensor) -> torch.Tensor:
    """Weight "prepacking": the stand-in keeps the plain ``[N, K]`` layout (a copy).

    The C++ kernel reorders the weight into AMX/VNNI tiles; the stand-in's
    :func:`weight_packed_linear` consumes the unpacked layout, so packing is the identity.
    Called from ``sglang/srt/layers/amx_utils.py::amx_process_weight_after_loading``.
    """
    return weight.clone()


def weight_packed_linear(mat1: torch.Tensor, mat2: torch.Tensor, bias: Optional[torch.Tensor],
                         is_vnni: bool) -> torch.Tensor:
    """``mat1 @ mat2.T + bias`` for a weight "packed" by :func:`convert_weight_packed`.

    Args: mat1 ``[M, K]``; mat2 ``[N, K]``; bias ``[N]`` or None; is_vnni ignored (no packing).
    Returns ``[M, N]`` of ``mat1.dtype``.
    Mirrors ``sglang/srt/layers/quantization/unquant.py::UnquantizedLinearMethod.apply``
    (the ``torch.nn.functional.linear`` branch).
    """
    return torch.nn.functional.linear(mat1, mat2.to(mat1.dtype),
                                      None if bias is None else bias.to(mat1.dtype))
