"""Process start hook for the reference server venv (loaded by ``e3f_standin.pth``).

When ``E3F_STANDIN_AMX=1`` is set (the launcher sets it for the server it starts), make
``torch.cpu._is_amx_tile_supported()`` return True before SGLang reads it at import of
``sglang/srt/utils/common.py`` (``is_amx_tile_supported``). SGLang then selects its ``intel_amx``
attention backend, the only CPU backend it allows for EAGLE (``sglang/srt/speculative/
draft_utils.py``), and routes all of that path's kernels to ``torch.ops.sgl_kernel``, which the
pure-torch stand-in provides. No AMX instruction is executed by the stand-in; it only has to be
*selected*. On a CPU build of torch it also makes ``torch.cuda.synchronize()`` a no-op (below). Without the
variable nothing is changed.
"""
import os

if os.environ.get("E3F_STANDIN_AMX") == "1":
    import torch

    torch.cpu._is_amx_tile_supported = lambda: True  # noqa: SLF001

    if not torch.cuda.is_available() and torch.version.cuda is None:
        # CPU torch raises "Torch not compiled with CUDA enabled" from torch.cuda.synchronize(). SGLang's MLA EAGLE-3
        # draft calls it unconditionally after sharing the target's embedding
        # (sglang/srt/models/kimi_k25_eagle3.py::Eagle3DeepseekV2ForCausalLM.set_embed / set_embed_and_head, reached
        # from speculative/eagle_worker_v2.py); there is no device to wait for on a CPU build, so it waits for
        # nothing. (torch.cuda.empty_cache() already returns quietly when CUDA was never initialised.)
        def _no_device_to_synchronize(device=None):
            return None

        torch.cuda.synchronize = _no_device_to_synchronize


if os.environ.get("E3F_LOOPBACK_STORE") == "1":
    # The embedded server listens on 127.0.0.1 only. SGLang's distributed init (`tcp://127.0.0.1:<nccl_port>`,
    # sglang/srt/distributed/parallel_state.py::init_distributed_environment) makes rank 0 host torch's TCPStore,
    # whose server binds every interface ("::") whatever the host name (torch/distributed/rendezvous.py::
    # _create_c10d_store -> TCPStore(is_master=True)). Hand it a socket bound to the loopback address instead
    # (TCPStore's master_listen_fd, which the libuv store accepts).
    import importlib
    import socket

    _rdv = importlib.import_module("torch.distributed.rendezvous")   # the attribute is the function rendezvous

    _create_store = _rdv._create_c10d_store
    _LISTENERS = []    # the sockets the stores listen on (kept open for the life of the process)

    def _loopback_store(hostname, port, rank, world_size, timeout, use_libuv=True):
        if rank != 0 or _rdv._torchelastic_use_agent_store() or hostname not in ("127.0.0.1", "localhost"):
            return _create_store(hostname, port, rank, world_size, timeout, use_libuv)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
        sock.listen(512)
        _LISTENERS.append(sock)
        return _rdv.TCPStore(host_name="127.0.0.1", port=port, world_size=world_size, is_master=True,
                             timeout=timeout, multi_tenant=True, master_listen_fd=sock.fileno(), use_libuv=True)

    _rdv._create_c10d_store = _loopback_store
