"""Page-locking host memory for fast device copies: the one place that does it.

DESIGN wants every accelerator call in hal/; hal has no pinned-memory helper yet, so this
small function lives here until it moves there. On a machine with no CUDA it does nothing.
"""

from __future__ import annotations

import torch

NOT_PINNED_CPU = "not pinned: no accelerator (a CPU pool copies host memory to host memory; nothing to pin for)"


def pin_status(pinned: bool) -> str:
    """What the host tier's start-up line says about its slab."""
    if pinned:
        return "pinned (page-locked for the accelerator's copies)"
    return NOT_PINNED_CPU if not torch.cuda.is_available() else "not pinned: cudaHostRegister refused the slab"


def pin_host_memory(tensor: torch.Tensor) -> bool:
    """Page-lock an existing CPU tensor's memory in place (cudaHostRegister) when CUDA is present.

    In place because the host tier's slab lives in a shared (memfd) arena the transport maps;
    `tensor.pin_memory()` would copy it elsewhere. Returns True when the memory is now pinned.
    Whoever unmaps the memory calls `unpin_host_memory` first: CUDA keeps a registration past the munmap, and a
    later mapping at the same addresses then fails (a second engine in the process could not load its model:
    "CUDA error: resource already mapped").
    """
    if not torch.cuda.is_available() or tensor.numel() == 0:
        return False
    nbytes = tensor.numel() * tensor.element_size()
    err = torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), nbytes, 0)
    return int(err) == 0 if not isinstance(err, tuple) else int(err[0]) == 0


def unpin_host_memory(tensor: torch.Tensor) -> None:
    """Undo `pin_host_memory` (cudaHostUnregister) before the memory is unmapped."""
    torch.cuda.cudart().cudaHostUnregister(tensor.data_ptr())
