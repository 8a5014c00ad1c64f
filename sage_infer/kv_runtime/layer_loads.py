"""`LayerLoads`: KV loaded at admission (a lower-tier hit, a received transfer) written into the pool one layer at a
time, each layer waited for only by the attention that reads it.

Loaded rows come in the tiers' byte format, block-major: row ``i`` is block ``i``'s ``[num_layers, 2, block_size,
KvH, D]``. Writing them whole before the step makes a long hit's first token wait for every byte of it. Here each
layer's share of the rows is its own copy:

- on a CUDA pool, every layer's copy is queued at admission on a copy stream (`sage_infer.hal.streams`), in layer
  order, each followed by an event; layer ``l``'s attention makes the compute stream wait for event ``l`` only, so
  the copies of later layers run while earlier layers compute (SGLang HiCache's layer-wise loading, vLLM's
  connector ``wait_for_layer_load``). The copy is a Triton kernel that reads the page-locked staging rows in place
  (mapped host memory) and scatters layer ``l`` of each row into its pool block: the rows' layer slices are strided
  (one per block), which a plain host-to-device copy cannot take without a host-side gather first. Rows that are
  not page-locked (a transfer's receive buffer) are written whole, as before.
- on a CPU pool (``kv_pool.layer_loads: on``), layer ``l``'s copy is made right before its attention reads it, on
  the engine thread: the same bytes move, later, next to their first reader.

`finish` completes every queued copy and releases the rows to their owner (the staging buffers a tier read lands
in): after the step's forward, and before whole-pool accesses (`KVPool.read_blocks`, `write_blocks`) and steps that
read the pool outside `paged_attention` (a CUDA graph's replay, the C++ decode step).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache

import torch

from sage_infer.hal import streams

try:
    import triton
    import triton.language as tl
except ImportError:  # optional: PyTorch's CUDA wheels bring it (`pip install triton` otherwise)
    triton = None
    tl = None

COPY_TILE = 4096  # elements per program of the copy kernel (a block's K or V of one layer may take several)


def _copy_layer(src_ptr, dst_ptr, ids_ptr, layer, num_layers, num_blocks, ELEMS: tl.constexpr,
                TILE_ELEMS: tl.constexpr):
    """Program (row, K or V, tile): layer `layer`'s K or V of staging row `row` into pool block ``ids[row]``.
    src: ``[n, num_layers, 2, ELEMS]``; dst (the pool): ``[2, num_layers, num_blocks, ELEMS]``."""
    row = tl.program_id(0)
    kv = tl.program_id(1)
    offsets = tl.program_id(2) * TILE_ELEMS + tl.arange(0, TILE_ELEMS)
    mask = offsets < ELEMS
    block = tl.load(ids_ptr + row).to(tl.int64)
    src = src_ptr + ((row.to(tl.int64) * num_layers + layer) * 2 + kv) * ELEMS
    dst = dst_ptr + ((kv.to(tl.int64) * num_layers + layer) * num_blocks + block) * ELEMS
    tl.store(dst + offsets, tl.load(src + offsets, mask=mask), mask=mask)


@cache
def _kernel():
    # `layer` unspecialized: Triton would compile a kernel for layer 1 and one for multiples of 16 besides the rest,
    # each on the first load that reached it
    return triton.jit(_copy_layer, do_not_specialize=["layer"])


def copy_layer_triton(kv: torch.Tensor, src: torch.Tensor, ids: torch.Tensor, layer: int) -> None:
    """Layer `layer` of `src` (``[n, num_layers, 2, ...]``: rows in the tiers' format, in the pool's dtype) into
    the pool storage `kv` (``[2, num_layers, num_blocks, ...]``) at blocks `ids` ([n] long, on kv's device), with
    the Triton kernel: on a GPU `src` is page-locked host memory read in place; on a CPU only under the
    interpreter (the tests)."""
    if triton is None:
        raise RuntimeError("the layer-wise KV copy needs triton (PyTorch's CUDA wheels bring it)")
    if kv.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("the Triton KV copy takes CPU tensors only under TRITON_INTERPRET=1")
    n, num_layers = src.shape[0], kv.shape[1]
    elems = kv[0, 0, 0].numel()
    tile = min(COPY_TILE, triton.next_power_of_2(elems))
    _kernel()[(n, 2, triton.cdiv(elems, tile))](src, kv, ids, layer, num_layers, kv.shape[2], ELEMS=elems,
                                               TILE_ELEMS=tile)


def copy_layer_torch(kv: torch.Tensor, src: torch.Tensor, ids: torch.Tensor, layer: int) -> None:
    """`copy_layer_triton`'s copy with PyTorch, both tensors on one device (a CPU pool)."""
    kv[:, layer].index_copy_(1, ids, src[:, layer].transpose(0, 1))


@dataclass(slots=True)
class _Held:
    rows: torch.Tensor  # the staging rows the copies read (kept alive, and from their owner, until they are done)
    release: Callable[[torch.Tensor], None]
    ids: torch.Tensor | None = None  # CUDA: the block ids the copy stream reads
    done: object | None = None  # CUDA: the copy stream's event after the load's last layer


class LayerLoads:
    """A pool's layer-wise loads: `add` at admission, `ready(layer)` in attention, `finish` after the step.

    `loads` and `layers_waited` count what happened (tests and benches read them).
    """

    def __init__(self, kv: torch.Tensor, num_layers: int) -> None:
        self.kv = kv
        self.num_layers = num_layers
        self.device = kv.device
        self.stream = streams.copy_stream(self.device) if self.device.type == "cuda" else None
        self._events: list[object | None] = [None] * num_layers  # CUDA: per layer, its latest copy's event
        # CPU: per layer, the (src, ids) still to copy into it
        self._todo: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in range(num_layers)]
        self._held: list[_Held] = []  # loads whose rows have not gone back yet
        self.pending = False  # copies queued or not yet made that a reader must wait for
        self.loads = 0
        self.layers_waited = 0
        if self.stream is not None:  # compile the copy kernel now, not in the first request's load
            src = torch.zeros((1, num_layers, 2, *kv.shape[3:]), dtype=kv.dtype, pin_memory=True)
            copy_layer_triton(kv, src, torch.zeros(1, dtype=torch.long, device=self.device), 0)  # (zeros, as made)
            torch.cuda.synchronize(self.device)

    def takes(self, rows: torch.Tensor) -> bool:
        """Whether `add` can take these rows: on a GPU, page-locked host rows (the kernel reads them in place)."""
        return self.stream is None or (rows.device.type == "cpu" and rows.is_pinned())

    def add(self, block_ids: Sequence[int], src: torch.Tensor, rows: torch.Tensor,
            release: Callable[[torch.Tensor], None]) -> None:
        """Queue `src` (`rows` as ``[n, num_layers, 2, ...]`` in the pool's dtype) for blocks `block_ids`;
        `release(rows)` once no copy reads them."""
        held = _Held(rows, release)
        if self.stream is None:
            ids = torch.tensor(list(block_ids), dtype=torch.long)
            for todo in self._todo:
                todo.append((src, ids))
        else:
            ids = held.ids = torch.tensor(list(block_ids), dtype=torch.long).to(self.device, non_blocking=True)
            streams.wait_for_current(self.stream)  # blocks the compute stream last used are written after it
            with streams.on(self.stream):
                for layer in range(self.num_layers):
                    copy_layer_triton(self.kv, src, ids, layer)
                    self._events[layer] = streams.record(self.stream)
            held.done = self._events[-1]
        self._held.append(held)
        self.pending = True
        self.loads += 1

    def ready(self, layer: int) -> None:
        """Layer `layer`'s loaded blocks are in the pool for whatever the compute stream runs next."""
        if self.stream is None:
            for src, ids in self._todo[layer]:
                copy_layer_torch(self.kv, src, ids, layer)
            waited = bool(self._todo[layer])
            self._todo[layer].clear()
        else:
            event = self._events[layer]
            waited = event is not None
            if waited:
                streams.current_waits(event)
                self._events[layer] = None
        self.layers_waited += waited

    def finish(self) -> None:
        """Every queued layer is in the pool (for the next reader on the compute stream), and the rows go back to
        their owner once their copies are done. On a GPU the host waits for the copies' last event: after a step the
        forward waited for them too, and the engine waits for the forward's tokens next, so this costs nothing; a row
        buffer kept past the step instead made the next load allocate (and page-lock) a new one, hundreds of ms for a
        long prompt's (`bench/load_vs_recompute.py --device cuda`)."""
        if self.pending:
            for layer in range(self.num_layers):
                self.ready(layer)
            self.pending = False
        for held in self._held:
            if held.done is not None:
                streams.synchronize(held.done)
            held.release(held.rows)
        self._held = []
