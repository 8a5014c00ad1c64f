"""`model.cuda_graphs: on`: pure decode steps replayed as CUDA graphs (`GraphStep`, over `DecodeGraphs`).

On a GPU a small model's decode step is host-bound: the engine launches every op of every layer from
Python, and the GPU spends most of a 0.5B batch-1 step waiting for launches (`bench/gpu_check.sh`,
docs/benchmarks.md "CUDA graphs for decode steps"). A
captured graph launches the whole step, embedding to logits, at once.

A graph replays fixed shapes at fixed addresses, so a pure decode step (every sequence computes one
token, its last) of ``n`` rows runs in the graph of the smallest bucket ``B >= n`` (`BUCKETS`, up to
the scheduler's ``max_num_seqs``), over static buffers: token ids, positions, KV slots, context
lengths and block tables as wide as the longest context the model takes. Rows ``n..B-1`` repeat row 0
(same token, position, slot and table), so they compute row 0's values again and write them to row 0's
slot: no slot outside the step is touched, no pool block is reserved. Attention is the in-place paged
kernel (Triton on CUDA) with one decode group of all rows, so nothing in the step depends on the
lengths; its split count follows the tables' full width. Cascade attention is not used in these steps
(the graph's shapes cannot depend on which rows share a prefix). A bucket's graph is captured the
first time a step needs it, after two eager warm-up runs on the step's own inputs (their K/V writes
are the step's, so the replay rewrites the same values). Steps that are not pure decode, or have more
rows than the largest bucket, run eagerly as before.

`capture=False` runs the same padded static-buffer forward eagerly: what the CPU tests check the
buffers' and the padding's logic with (the C++ paged kernel), since no graph can be captured there.
"""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING

import torch
from torch import nn

from sage_infer.core.sequence import Sequence
from sage_infer.engine.steps.base import StepExecutor
from sage_infer.kv_runtime.pool import KVPool
from sage_infer.layers.attention_backends import PAGED_DECODE, AttentionBackend

if TYPE_CHECKING:
    from sage_infer.engine.model_runner import ModelRunner

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


class DecodeGraphs:
    """The graphs of pure decode steps, one per batch bucket, over shared static input buffers.
    `captures` and `replays` count what happened (replays include the eager runs of ``capture=False``)."""

    def __init__(self, model: nn.Module, pool: KVPool, device: torch.device, max_batch: int, max_blocks: int,
                 capture: bool = True, attention: AttentionBackend = PAGED_DECODE) -> None:
        assert attention.decode_in_place, "a graph's decode rows read their blocks in place, one group of all rows"
        self.model = model
        self.attention = attention
        self.pool = pool
        self.block_size = pool.block_size
        largest = min(max_batch, BUCKETS[-1])  # bigger batches run eagerly (launches matter less there)
        self.buckets = [b for b in BUCKETS if b < largest] + [largest]
        self.max_blocks = max_blocks
        self.capture = capture
        self.inputs = torch.zeros(4, largest, dtype=torch.long, device=device)  # ids, positions, slots, lengths
        self.tables = torch.zeros(largest, max_blocks, dtype=torch.long, device=device)
        self.rows = torch.arange(largest, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.mempool = torch.cuda.graph_pool_handle() if capture else None
        self.captures = 0
        self.replays = 0

    def fits(self, seqs: list[Sequence], num_new_tokens: list[int]) -> bool:
        """Whether this step is pure decode within the largest bucket: every sequence computes one token,
        its last (a one-token prefill chunk before the prompt's end is not), within `max_blocks`."""
        return 0 < len(seqs) <= self.buckets[-1] and all(
            n == 1 and seq.num_computed_tokens + 1 == seq.num_tokens and len(seq.block_table) <= self.max_blocks
            for seq, n in zip(seqs, num_new_tokens))

    def run(self, seqs: list[Sequence]) -> torch.Tensor:
        """The step of `seqs` (`fits` said yes) -> logits [len(seqs), vocab] float32, one row per sequence."""
        n = len(seqs)
        bucket = self.buckets[bisect.bisect_left(self.buckets, n)]
        bs = self.block_size
        ids, positions, slots, lengths = [], [], [], []
        for seq in seqs:
            pos = seq.num_computed_tokens
            ids.append(seq.token_ids[pos])
            positions.append(pos)
            slots.append(seq.block_table[pos // bs] * bs + pos % bs)
            lengths.append(pos + 1)
        pad = bucket - n
        host = torch.tensor([column + column[:1] * pad for column in (ids, positions, slots, lengths)])
        width = max(len(seq.block_table) for seq in seqs)
        tables = [seq.block_table + [0] * (width - len(seq.block_table)) for seq in seqs]
        host_tables = torch.tensor(tables + tables[:1] * pad)
        self.inputs[:, :bucket].copy_(host)
        # entries past a row's `width` keep older steps' values: the kernel reads no block past a row's length
        self.tables[:bucket, :width].copy_(host_tables)
        self.replays += 1
        if not self.capture:
            return self._forward(bucket)[:n]
        if bucket not in self.graphs:
            self.graphs[bucket] = self._capture(bucket)
        graph, logits = self.graphs[bucket]
        graph.replay()
        return logits[:n].clone()  # the graph pool's output is rewritten by the next replay

    def _forward(self, bucket: int) -> torch.Tensor:
        meta = self.attention.prepare_static_decode(self.inputs[2, :bucket], self.tables[:bucket],
                                                    self.inputs[3, :bucket], self.rows[:bucket])
        hidden = self.model(self.inputs[0, :bucket], self.inputs[1, :bucket], self.pool, meta)
        return self.model.compute_logits(hidden)

    def _capture(self, bucket: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up off the capture: Triton compiles, cuBLAS picks its kernels
            for _ in range(2):
                self._forward(bucket)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.mempool, capture_error_mode="thread_local"):
            logits = self._forward(bucket)
        self.captures += 1
        return graph, logits


class GraphStep(StepExecutor):
    """A pure decode step within the largest bucket replays a CUDA graph (`DecodeGraphs`, built from the same
    arguments, which fills its own static inputs from the sequences); other steps run layer by layer with PyTorch's
    elementwise ops."""

    name = "cuda-graphs"

    def __init__(self, *args: object, **kwargs: object) -> None:
        self.graphs = DecodeGraphs(*args, **kwargs)

    def run(self, runner: ModelRunner, seqs: list[Sequence], num_new_tokens: list[int]) -> tuple[torch.Tensor,
                                                                                                    list[int]]:
        if self.graphs.fits(seqs, num_new_tokens):
            runner.pool.finish_loads()  # the replay reads the pool without `paged_attention`'s per-layer waits
            return self.graphs.run(seqs), list(range(len(seqs)))
        return super().run(runner, seqs, num_new_tokens)
