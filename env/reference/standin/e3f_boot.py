"""Process start hook for the reference server venv (loaded by ``e3f_standin.pth``).

When ``E3F_STANDIN_AMX=1`` is set (the launcher sets it for the server it starts), make
``torch.cpu._is_amx_tile_supported()`` return True before SGLang reads it at import of
``sglang/srt/utils/common.py`` (``is_amx_tile_supported``). SGLang then selects its ``intel_amx``
attention backend, the only CPU backend it allows for EAGLE (``sglang/srt/speculative/
draft_utils.py``), and routes all of that path's kernels to ``torch.ops.sgl_kernel``, which the
pure-torch stand-in provides. No AMX instruction is executed by the stand-in; it only has to be
*selected*. Without the variable nothing is changed.
"""
import os

if os.environ.get("E3F_STANDIN_AMX") == "1":
    import torch

    torch.cpu._is_amx_tile_supported = lambda: True  # noqa: SLF001
