"""Shared-memory all-reduce / all-gather for TP ranks on one host (what ``sgl-kernel``'s
``shm.cpp`` does in C++), in Python: one ``/dev/shm`` segment with a slot per rank, a futex-based
barrier, and a fixed summation order so every rank gets bit-identical results.

Why: gloo's TCP all-reduce costs ~1 ms at TP 2 and ~15 ms at TP 8 on a 2-core machine (measured,
bench/RESULTS.md), and SGLang issues two per layer per forward. Here an all-reduce is: copy the
local tensor into this rank's slot, barrier, sum the slots in rank order, barrier.

Layout of the segment ``/dev/shm/e3f-sglkernel-<key>``: a 4 KiB header (int32 words: [0] arrival
count, [1] barrier generation), then ``world`` slots of ``slot_bytes`` each. Arrival counts are
updated under ``flock`` on the segment; waiters sleep in ``futex(FUTEX_WAIT)`` on the generation
word (shared futex, works across processes) and the last arrival wakes them with
``FUTEX_WAKE``. A wait that exceeds ``timeout`` seconds raises (a dead peer must not hang a
server forever).
"""
from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import time
from typing import Optional

import numpy as np
import torch

_SYS_FUTEX = {"x86_64": 202, "aarch64": 98}.get(os.uname().machine)
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1
HEADER = 4096
_libc = ctypes.CDLL(None, use_errno=True)


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class ShmGroup:
    """Shared-memory collectives for ``world`` ranks of one host; ``rank`` is this process."""

    def __init__(self, key: str, world: int, rank: int, slot_bytes: int = 8 << 20,
                 timeout: float = 600.0):
        if _SYS_FUTEX is None:
            raise RuntimeError(f"futex syscall number unknown on {os.uname().machine}")
        self.world, self.rank, self.slot_bytes, self.timeout = world, rank, slot_bytes, timeout
        self.path = f"/dev/shm/e3f-sglkernel-{key}"
        size = HEADER + world * slot_bytes
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        if os.fstat(self.fd).st_size < size:
            os.ftruncate(self.fd, size)
        self.mm = mmap.mmap(self.fd, size)
        self.header = np.frombuffer(self.mm, dtype=np.int32, count=2)
        self.base = ctypes.addressof(ctypes.c_char.from_buffer(self.mm))
        self.gen_addr = self.base + 4
        self.slots = torch.frombuffer(self.mm, dtype=torch.uint8, offset=HEADER,
                                      count=world * slot_bytes).view(world, slot_bytes)

    # -- barrier -------------------------------------------------------------------------------
    def _futex(self, op: int, val: int, timeout: Optional[float] = None) -> int:
        ts = None
        if timeout is not None:
            ts = ctypes.byref(_Timespec(int(timeout), int((timeout % 1) * 1e9)))
        return _libc.syscall(_SYS_FUTEX, ctypes.c_void_p(self.gen_addr), op, val, ts, None, 0)

    def barrier(self) -> None:
        """Block until all ``world`` ranks have called it (then all return)."""
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        try:
            gen = int(self.header[1])
            self.header[0] += 1
            last = int(self.header[0]) == self.world
            if last:
                self.header[0] = 0
                self.header[1] = gen + 1
        finally:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
        if last:
            self._futex(_FUTEX_WAKE, 0x7FFFFFFF)
            return
        deadline = time.monotonic() + self.timeout
        while int(self.header[1]) == gen:
            self._futex(_FUTEX_WAIT, gen, 1.0)  # returns at once if the word already changed
            if time.monotonic() > deadline:
                raise TimeoutError(f"shm barrier: rank {self.rank} waited {self.timeout:.0f} s for "
                                   f"{self.world} ranks ({self.path})")

    # -- collectives ---------------------------------------------------------------------------
    def fits(self, t: torch.Tensor) -> bool:
        return t.numel() * t.element_size() <= self.slot_bytes

    def _slot(self, r: int, t: torch.Tensor) -> torch.Tensor:
        n = t.numel() * t.element_size()
        return self.slots[r, :n].view(t.dtype).view(t.shape)

    def all_reduce_(self, t: torch.Tensor) -> None:
        """In-place sum over ranks; accumulates in float32 for half types, rank order 0..world-1."""
        src = t.contiguous()
        self._slot(self.rank, src).copy_(src)
        self.barrier()
        acc_dtype = torch.float32 if t.dtype in (torch.bfloat16, torch.float16) else t.dtype
        acc = self._slot(0, src).to(acc_dtype, copy=True)
        for r in range(1, self.world):
            acc += self._slot(r, src).to(acc_dtype)
        self.barrier()
        t.copy_(acc.view(t.shape))

    def all_gather(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """Concatenation of every rank's ``t`` along ``dim`` (rank order)."""
        src = t.contiguous()
        self._slot(self.rank, src).copy_(src)
        self.barrier()
        out = torch.cat([self._slot(r, src).clone() for r in range(self.world)], dim=dim)
        self.barrier()
        return out

    def unlink(self) -> None:
        """Remove the segment's name (mappings stay valid; the memory goes with the last one)."""
        try:
            os.unlink(self.path)
        except OSError:
            pass

    def close(self, unlink: bool = False) -> None:
        try:
            self.mm.close()
            os.close(self.fd)
        except (OSError, BufferError, ValueError):
            pass
        if unlink:
            try:
                os.unlink(self.path)
            except OSError:
                pass
