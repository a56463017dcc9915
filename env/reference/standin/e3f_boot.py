"""Process start hook for the reference server venv (loaded by ``e3f_standin.pth``).

When ``E3F_STANDIN_AMX=1`` is set (the launcher sets it for the server it starts), make
``torch.cpu._is_amx_tile_supported()`` return True before SGLang reads it at import of
``sglang/srt/utils/common.py`` (``is_amx_tile_supported``). SGLang then selects its ``intel_amx``
attention backend, the only CPU backend it allows for EAGLE (``sglang/srt/speculative/
draft_utils.py``), and routes all of that path's kernels to ``torch.ops.sgl_kernel``, which the
pure-torch stand-in provides. No AMX instruction is executed by the stand-in; it only has to be
*selected*. On a CPU build of torch it also makes ``torch.cuda.synchronize()`` a no-op (below). Without the
variable nothing is changed. ``E3F_LOOPBACK_STORE=1`` binds torch's TCPStore to 127.0.0.1; ``E3F_TEST_CANARY_CPU=1``
(test-only: bench/bench_integrity.py sets it, nothing in helpers/ does) lets SGLang's KV canary run on CPU torch.
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


if os.environ.get("E3F_TEST_CANARY_CPU") == "1":
    # Test-only (bench/bench_integrity.py sets it; nothing under helpers/ does): let SGLang's KV canary start on a CPU
    # build of torch. Its kernels already fall back to a torch reference off CUDA
    # (sglang/kernels/ops/kv_canary/_dispatch.py::use_torch_reference); what stops it is the device-to-host plumbing:
    # sglang/srt/utils/common.py::create_device_stream calls torch.cpu.Stream(device=...), which takes no device, and
    # runner/future_tensor.py, req_to_expected_token_ids_manager.py ask for pinned host memory, which needs CUDA. On
    # CPU the "device" already is host memory, so a stream that ignores the device and unpinned tensors do the same.
    import torch

    if not torch.cuda.is_available():
        _CpuStream = torch.cpu.Stream

        class _AnyDeviceCpuStream(_CpuStream):
            def __init__(self, device=None, priority=0, **kwargs):
                super().__init__(priority=priority)

        torch.cpu.Stream = _AnyDeviceCpuStream

        def _unpinned(factory):
            def make(*args, pin_memory=False, **kwargs):
                return factory(*args, **kwargs)
            make.__name__ = factory.__name__
            return make

        for _name in ("empty", "zeros", "tensor"):
            setattr(torch, _name, _unpinned(getattr(torch, _name)))
        torch.Tensor.pin_memory = lambda self, *args, **kwargs: self

        # Two Triton-only kernels on the canary's path have no torch reference: the phase checker it steps around
        # every forward (sglang/srt/utils/phase_checker.py::SimplePhaseChecker.update) and the scatter of each
        # request's expected token ids (sglang/kernels/ops/kv_canary/scatter_req_token_ids.py::
        # launch_scatter_req_token_ids_kernel, with SGLANG_KV_CANARY_ENABLE_VERIFY_TOKEN_ASSERT). Each is replaced,
        # right after its module is first imported, by the same computation in torch (their docstrings' contracts).
        import importlib.abc
        import importlib.machinery
        import sys

        def _phase_update(self, *, expect_phase, next_phase, caller_name=""):
            if int(self._enable_assert_device.reshape(-1)[0]) != 0 and int(self._phase) != int(expect_phase):
                raise AssertionError(f"SimplePhaseChecker: phase mismatch (caller {caller_name!r}: expect "
                                     f"{int(expect_phase)}, actual {int(self._phase)})")
            self._phase.fill_(int(next_phase))

        def _scatter(*, flat_in, offsets, req_pool_indices, pool_out):
            width = int(pool_out.shape[1])
            for r in range(int(req_pool_indices.shape[0])):
                start, end = int(offsets[r]), int(offsets[r + 1])
                n = min(end - start, width)
                pool_out[int(req_pool_indices[r]), :n] = flat_in[start:start + n].to(torch.int32)

        def _patch_phase(mod):
            mod.SimplePhaseChecker.update = _phase_update

        def _patch_scatter(mod):
            mod.launch_scatter_req_token_ids_kernel = _scatter

        _PATCHES = {"sglang.srt.utils.phase_checker": _patch_phase,
                    "sglang.kernels.ops.kv_canary.scatter_req_token_ids": _patch_scatter}

        class _PatchAfterImport(importlib.abc.MetaPathFinder):
            def find_spec(self, fullname, path, target=None):
                if fullname not in _PATCHES:
                    return None
                spec = importlib.machinery.PathFinder.find_spec(fullname, path)
                if spec is None or spec.loader is None:
                    return spec
                run = spec.loader.exec_module

                def exec_module(module, _run=run, _patch=_PATCHES[fullname]):
                    _run(module)
                    _patch(module)
                spec.loader.exec_module = exec_module
                return spec

        sys.meta_path.insert(0, _PatchAfterImport())
