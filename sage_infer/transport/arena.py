"""`SharedArena`: host memory that another local process can map, handed out as tensors.

The shm backend's ring is one too (the sender's), mapped by the receiver.

A receiver that allocates its KV destination here (`arena.tensor(...)`) and listens on
the `shm` backend with it gets zero-copy delivery: the sender maps the same pages (the
file descriptor travels once, at connection set-up) and copies each chunk straight into
place, so the receiver only checks the CRC. This is the one-sided write into registered
memory that RDMA engines (Mooncake, NIXL) do, on one host.
"""

from __future__ import annotations

import mmap
import os
import tempfile

import numpy as np
import torch

from sage_infer.transport.transport_errors import TransportError

ALIGN = 4096  # page-aligned tensors: no chunk straddles a cache line another tensor uses


def _anonymous_file() -> int:
    """A file with no name: it lives while some process holds its descriptor or a mapping."""
    if hasattr(os, "memfd_create"):
        return os.memfd_create("sage-kv-shm", os.MFD_CLOEXEC)
    # pragma: no cover - non-Linux: an unlinked temp file has the same lifetime rules
    fd, path = tempfile.mkstemp(prefix="sage-kv-shm-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    os.unlink(path)
    return fd


class SharedArena:
    def __init__(self, nbytes: int, *, fd: int | None = None) -> None:
        """A new pre-faulted arena of `nbytes`, or (with `fd`) a mapping of a peer's arena."""
        if nbytes <= 0:
            raise ValueError(f"arena size must be > 0, got {nbytes}")
        self.nbytes = nbytes
        self.owner = fd is None
        if fd is None:
            fd = _anonymous_file()
            try:
                os.ftruncate(fd, nbytes)
                self.map = mmap.mmap(fd, nbytes)
            except OSError as err:
                os.close(fd)
                raise TransportError(f"cannot create a {nbytes >> 20} MiB shared arena ({err})") from None
        else:
            self.map = mmap.mmap(fd, nbytes)
        self.fd = fd
        self.array = np.frombuffer(self.map, dtype=np.uint8)
        if self.owner:
            self.array.fill(0)  # first touch now, not during a transfer
        self.base = self.array.ctypes.data
        self._next = 0

    def tensor(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A zeroed tensor carved from the arena (bump allocation, page aligned)."""
        count = 1
        for dim in shape:
            count *= dim
        nbytes = count * torch.empty((), dtype=dtype).element_size()
        start = -(-self._next // ALIGN) * ALIGN
        if start + nbytes > self.nbytes:
            raise TransportError(f"shared arena full: {nbytes} bytes asked, {self.nbytes - start} left")
        self._next = start + nbytes
        flat = torch.from_numpy(self.array[start : start + nbytes])
        return flat.view(dtype).view(shape)

    def offset_of(self, view) -> int | None:
        """Byte offset of a buffer (tensor, numpy array or memoryview) inside the arena, or None."""
        if isinstance(view, torch.Tensor):
            address = view.data_ptr()
            size = view.numel() * view.element_size()
        else:
            array = np.frombuffer(view, dtype=np.uint8)
            address, size = array.ctypes.data, array.nbytes
        offset = address - self.base
        return offset if 0 <= offset and offset + size <= self.nbytes else None

    def close(self) -> None:
        del self.array
        try:
            self.map.close()
        except BufferError:  # tensors still point here; the mapping lives until they go
            pass
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
