"""`sage transport bench`: real sender and receiver processes on this host, per backend,
next to the raw baseline measured in the same run.

Baselines (what the backend adds overhead to):
- shm: one process memcpy of the same bytes, chunk by chunk, into a pre-faulted shared mapping;
- tcp: a plain blocking socket `sendall` / `recv_into` loop of the same chunks between two processes;
- torchdist: plain `dist.send` / `dist.recv` of the same chunks (gloo) between two processes.

A transfer's time runs from its first send to the last verified ACK, so it covers the
receiver's copy-out, CRC check and (when converting) decode. Next to it: each side's
event-loop thread CPU per chunk (torchdist waits on its works in other threads, so its
figures leave those out).
"""

from __future__ import annotations

import asyncio
import math
import multiprocessing as mp
import os
import socket
import statistics
import time
from dataclasses import asdict, dataclass

import crc32c
import numpy as np
import torch

from sage_infer.config.transport import KVTransportConfig
from sage_infer.hal.net import free_port
from sage_infer.transport import KVReceiveBuffers, TransportEngine
from sage_infer.transport.arena import ALIGN, SharedArena
from sage_infer.transport.planner import TORCH_OF
from sage_infer.transport.telemetry import TransportTelemetry

HEADS, HEAD_DIM = 8, 128
LAYERS = 8
BACKENDS = ("shm", "tcp", "torchdist")


@dataclass(slots=True)
class BenchResult:
    backend: str
    chunk_bytes: int
    dtype: str  # wire dtype
    gbps: float  # KV bytes (as stored) per second, end to end
    baseline_gbps: float
    ratio_to_baseline: float
    p50_chunk_us: float
    p99_chunk_us: float
    convert_share: float  # max(sender encode, receiver decode) seconds / transfer seconds (they run in parallel)
    receiver_cpu_share: float  # receiver thread CPU seconds / transfer seconds (what is left for its own work)
    wire_bytes: int
    total_bytes: int
    retransmits: int
    zero_copy: bool = False
    rel_rmse: float = 0.0  # reconstruction error of the wire format on this KV (0: as stored)
    crc_baseline_gbps: float = 0.0  # the baseline with a CRC32C of every chunk (what a checksummed transfer pays)
    # shm: the baseline's memcpy, from this transfer's own KV tensors instead of a numpy buffer. numpy backs large
    # arrays with transparent huge pages where the kernel offers them (madvise), torch does not: context for the
    # ratio, which stays against the baseline
    kv_memcpy_gbps: float = 0.0
    # CPU time of each side's event-loop thread per chunk (copy and checksum included): what a chunk costs, which
    # a busy machine disturbs far less than it disturbs GB/s
    sender_cpu_us_per_chunk: float = 0.0
    receiver_cpu_us_per_chunk: float = 0.0
    # GB/s of KV as stored against the same transfer sent as stored (no conversion: same backend, chunk and
    # zero-copy mode, in this run); 0 when that was not run
    ratio_to_as_stored: float = 0.0
    # shm with a CRC32C: the copies alone in two processes (`shm_bound_gbps`), what no per-chunk work could beat
    bound_gbps: float = 0.0


def kv_shape(total_bytes: int, dtype: torch.dtype) -> tuple[int, ...]:
    """Shape of one of `LAYERS` KV tensors [2, tokens, HEADS, HEAD_DIM] adding up to about `total_bytes`."""
    row = HEADS * HEAD_DIM * dtype.itemsize * 2
    return (2, max(1, total_bytes // LAYERS // row), HEADS, HEAD_DIM)


def kv_layers(total_bytes: int, dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
    """`LAYERS` random KV tensors of `kv_shape`."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(kv_shape(total_bytes, dtype), generator=g).to(dtype) for _ in range(LAYERS)]


def _init_dist(rank: int, port: int) -> None:
    import datetime

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))


# -- transport runs --------------------------------------------------------------


def _receiver(q, backend: str, size: int, src_dtype: str, repeats: int, dist_port: int, threads: int,
              zero_copy: bool = False, checksum: str = "crc32c") -> None:
    torch.set_num_threads(threads)
    if backend == "torchdist":
        _init_dist(1, dist_port)

    async def main() -> None:
        engine = TransportEngine(KVTransportConfig(backend=backend, checksum=checksum), telemetry=_telemetry())
        dtype = TORCH_OF[src_dtype]
        shape = kv_shape(size, dtype)
        arena = SharedArena(size + LAYERS * ALIGN + (1 << 20)) if zero_copy else None
        listener = await engine.listen(backend, "torchdist://0" if backend == "torchdist" else None, arena=arena)
        q.put(listener.address)
        loop = asyncio.get_running_loop()
        channel = await listener.accept(loop.time() + 60)
        if arena is not None:
            dest = [arena.tensor(shape, dtype) for _ in range(LAYERS)]  # pre-faulted by the arena
        else:
            dest = [torch.zeros(shape, dtype=dtype) for _ in range(LAYERS)]  # zeros: pre-faulted
        buffers = KVReceiveBuffers()
        decode, cpu, cpu_per_chunk = [], [], []
        for i in range(repeats):
            buffers.register(f"r{i}", dest)
            before_cpu = time.thread_time()
            stats = await engine.receive(channel, buffers, [f"r{i}"], deadline_s=120)
            spent = time.thread_time() - before_cpu
            cpu.append(spent / max(stats[f"r{i}"].seconds, 1e-9))
            cpu_per_chunk.append(spent / max(stats[f"r{i}"].chunks, 1))
            decode.append(stats[f"r{i}"].convert_seconds)
            buffers.release(f"r{i}")
        q.put((decode, cpu, cpu_per_chunk))
        await channel.aclose()
        await listener.aclose()

    asyncio.run(main())


def _telemetry() -> TransportTelemetry:
    from prometheus_client import CollectorRegistry

    return TransportTelemetry(CollectorRegistry())


def run_transport(backend: str, size: int, chunk: int, wire: str, src_dtype: str = "fp16", repeats: int = 4,
                  threads: int = 1, zero_copy: bool = False, checksum: str = "crc32c") -> dict:
    """Median end-to-end figures of `repeats` transfers (after one warm-up) of `size` bytes."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    proc = ctx.Process(target=_receiver, args=(q, backend, size, src_dtype, repeats + 1, port, threads, zero_copy,
                                               checksum))
    proc.start()
    try:
        torch.set_num_threads(threads)
        if backend == "torchdist":
            _init_dist(0, port)
        address = q.get(timeout=60)
        target = None if wire == src_dtype else wire
        config = KVTransportConfig(backend=backend, chunk_size=chunk, target_dtype=target, max_inflight=8,
                                   checksum=checksum)
        engine = TransportEngine(config, telemetry=_telemetry())
        layers = kv_layers(size, TORCH_OF[src_dtype])
        runs, sender_cpu = [], []

        async def send() -> None:
            conn = await engine.connect(address, backend=backend)
            for i in range(repeats + 1):
                plan, _ = engine.plan(f"r{i}", layers)
                before_cpu = time.thread_time()
                runs.append(await engine.stream_pipeline(conn, plan.chunks, plan, layers, deadline_s=120,
                                                         wait_placement=zero_copy))
                sender_cpu.append((time.thread_time() - before_cpu) / max(runs[-1].chunks, 1))
            await conn.aclose()

        asyncio.run(send())
        decode, receiver_cpu, receiver_cpu_per_chunk = q.get(timeout=120)
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
        if backend == "torchdist":
            import torch.distributed as dist

            dist.destroy_process_group()
    measured = runs[1:]
    best = sorted(measured, key=lambda s: s.seconds)[len(measured) // 2]
    seconds = statistics.median(s.seconds for s in measured)
    convert = statistics.median(max(s.convert_seconds, d) for s, d in zip(measured, decode[1:]))
    latencies = np.concatenate([np.asarray(s.chunk_seconds) for s in measured]) * 1e6
    return {
        "gbps": best.bytes / seconds / 1e9,
        "p50_chunk_us": float(np.quantile(latencies, 0.5)),
        "p99_chunk_us": float(np.quantile(latencies, 0.99)),
        "convert_share": convert / seconds,
        "wire_bytes": best.wire_bytes,
        "total_bytes": best.bytes,
        "retransmits": sum(s.retransmits for s in measured),
        "receiver_cpu_share": statistics.median(receiver_cpu[1:]),
        "sender_cpu_us_per_chunk": statistics.median(sender_cpu[1:]) * 1e6,
        "receiver_cpu_us_per_chunk": statistics.median(receiver_cpu_per_chunk[1:]) * 1e6,
    }


# -- baselines -------------------------------------------------------------------


def memcpy_to_shm_gbps(size: int, chunk: int, repeats: int = 4, crc: bool = False,
                       layers: list[torch.Tensor] | None = None) -> float:
    """One process copying `size` bytes chunk by chunk into a pre-faulted shared mapping (`crc`: and taking a
    CRC32C of each chunk's source right after its copy, as the shm sender does). The source is one numpy
    buffer, or with `layers` those tensors' bytes, layer by layer."""
    if layers is None:
        one = np.frombuffer(os.urandom(min(size, 1 << 20)) * (size // min(size, 1 << 20) + 1), np.uint8)[:size]
        sources = [one.copy()]
    else:
        sources = [t.reshape(-1).view(torch.uint8).numpy() for t in layers]
    size = sum(len(s) for s in sources)
    shm = SharedArena(size)  # pre-faulted, like the transport's ring
    dst = shm.array
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        base = 0
        for src in sources:
            for off in range(0, len(src), chunk):
                piece = src[off : off + chunk]
                np.copyto(dst[base + off : base + off + len(piece)], piece)
                if crc:
                    crc32c.crc32c(piece)
            base += len(src)
        times.append(time.perf_counter() - start)
    del dst
    shm.close()
    return size / statistics.median(times[1:]) / 1e9


def _chunk_spans(lengths: list[int], chunk: int) -> list[tuple[int, int, int]]:
    """(layer, offset in it, bytes) of every chunk of layers of these byte lengths, in sending order."""
    return [(layer, off, min(chunk, n - off)) for layer, n in enumerate(lengths) for off in range(0, n, chunk)]


def _bound_receiver(ring_name: str, ctl_name: str, lengths: list[int], chunk: int, slots: int, rounds: int,
                    direct: bool) -> None:
    from multiprocessing import shared_memory

    from sage_infer.quantization.kv_codec_kernel import array_copier, crc32c_array

    parent = os.getppid()
    copy_crc32c = array_copier()  # (chosen once, as a transport connection does)
    ring, ctl = shared_memory.SharedMemory(ring_name), shared_memory.SharedMemory(ctl_name)
    try:
        data, counters = np.ndarray((ring.size,), np.uint8, ring.buf), np.ndarray((16,), np.int64, ctl.buf)
        dest = [np.zeros(n, np.uint8) for n in lengths]  # pre-faulted, like a receiver's registered buffers
        spans = _chunk_spans(lengths, chunk)
        got = 0
        counters[8] = -1  # ready
        for _ in range(rounds):
            at = 0
            for layer, off, n in spans:
                spins = 0
                while counters[0] <= got:  # spin: the bound has no synchronisation cost
                    spins += 1
                    if not spins & 0xFFFFF and os.getppid() != parent:
                        return  # the sender is gone
                if direct:  # zero-copy: the sender wrote the destination; only its CRC is checked
                    crc32c_array(data[at : at + n])
                    at += n
                else:
                    start = (got % slots) * chunk
                    copy_crc32c(dest[layer][off : off + n], data[start : start + n], 0, -1)
                got += 1
                counters[8] = got
        del data, counters
    finally:
        ring.close()
        ctl.close()


def shm_bound_gbps(layers: list[torch.Tensor], chunk: int, repeats: int = 4, ring_bytes: int = 8 << 20,
                   direct: bool = False) -> float | None:
    """The shm transport's bound: the copies a checksummed transfer of `layers` makes and nothing else, in two
    processes. The sender copies each chunk of each layer into a ring of `ring_bytes` with its CRC32C in the same
    pass (the one-pass kernel, streaming stores from 1 MiB, as the transport's), the receiver copies it out into its
    buffer with its CRC32C, the two synchronised by spinning on counters in shared memory: no socket, no event
    loop, no headers. `direct`: the zero-copy mode's work instead (the sender writes the destination, the receiver
    only checksums it). None where the one-pass kernel does not load."""
    from multiprocessing import shared_memory

    from sage_infer.quantization.kv_codec_kernel import array_copier

    copy_crc32c = array_copier()  # (chosen once, as a transport connection does)
    if copy_crc32c is None:
        return None
    sources = [t.reshape(-1).view(torch.uint8).numpy() for t in layers]
    lengths = [len(src) for src in sources]
    size = sum(lengths)
    spans = _chunk_spans(lengths, chunk)
    slots = max(2, ring_bytes // chunk)
    ring = shared_memory.SharedMemory(create=True, size=size if direct else slots * chunk)
    ctl = shared_memory.SharedMemory(create=True, size=128)
    data = counters = proc = None
    finished = False
    try:
        data, counters = np.ndarray((ring.size,), np.uint8, ring.buf), np.ndarray((16,), np.int64, ctl.buf)
        data.fill(0)  # pre-faulted, as the transport's ring is
        counters[:] = 0
        proc = mp.get_context("spawn").Process(target=_bound_receiver, args=(ring.name, ctl.name, lengths, chunk,
                                                                              slots, repeats + 1, direct), daemon=True)
        proc.start()
        deadline = time.monotonic() + 60
        while counters[8] != -1:
            if not proc.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the bound's receiver process did not start")
            time.sleep(0.01)
        counters[8] = 0
        sent, times = 0, []
        for _ in range(repeats + 1):
            start, at = time.perf_counter(), 0
            for layer, off, n in spans:
                if not direct:
                    spins = 0
                    while sent - counters[8] >= slots:  # the ring is full: wait for the receiver
                        spins += 1
                        if not spins & 0xFFFFF and not proc.is_alive():
                            raise RuntimeError("the bound's receiver process died")
                    at = (sent % slots) * chunk
                copy_crc32c(data[at : at + n], sources[layer][off : off + n], 0, -1)
                if direct:
                    at += n
                sent += 1
                counters[0] = sent
            while counters[8] < sent:
                if not proc.is_alive():
                    raise RuntimeError("the bound's receiver process died")
            times.append(time.perf_counter() - start)
        finished = True
        return size / statistics.median(times[1:]) / 1e9
    finally:
        if proc is not None:
            if not finished:  # it would spin on, waiting for chunks
                proc.kill()
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
        del data, counters
        ring.close()
        ring.unlink()
        ctl.close()
        ctl.unlink()


def _socket_sink(port_q, size: int, chunk: int, repeats: int) -> None:
    server = socket.create_server(("127.0.0.1", 0))
    port_q.put(server.getsockname()[1])
    conn, _ = server.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = np.zeros(size, np.uint8)
    view = memoryview(buf)
    for _ in range(repeats + 1):
        got = 0
        while got < size:
            n = conn.recv_into(view[got : got + min(chunk, size - got)])
            if n == 0:
                return
            got += n
        conn.sendall(b"k")
    conn.close()


def plain_socket_gbps(size: int, chunk: int, repeats: int = 4) -> float:
    """A blocking `sendall` / `recv_into` loop of the same chunks over loopback TCP."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=_socket_sink, args=(q, size, chunk, repeats))
    proc.start()
    src = memoryview(np.random.default_rng(0).integers(0, 255, size, dtype=np.uint8))
    times = []
    with socket.create_connection(("127.0.0.1", q.get(timeout=30))) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(repeats + 1):
            start = time.perf_counter()
            for off in range(0, size, chunk):
                sock.sendall(src[off : off + chunk])
            sock.recv(1)
            times.append(time.perf_counter() - start)
    proc.join(timeout=30)
    return size / statistics.median(times[1:]) / 1e9


def _dist_sink(port: int, size: int, chunk: int, repeats: int) -> None:
    import torch.distributed as dist

    _init_dist(1, port)
    buf = torch.zeros(size, dtype=torch.uint8)
    for _ in range(repeats + 1):
        for off in range(0, size, chunk):
            dist.recv(buf[off : off + chunk], src=0)
        dist.send(torch.ones(1, dtype=torch.uint8), dst=0)
    dist.destroy_process_group()


def plain_dist_gbps(size: int, chunk: int, repeats: int = 4) -> float:
    """Plain `dist.send` / `dist.recv` of the same chunks (gloo)."""
    import torch.distributed as dist

    port = free_port()
    proc = mp.get_context("spawn").Process(target=_dist_sink, args=(port, size, chunk, repeats))
    proc.start()
    _init_dist(0, port)
    src = torch.randint(0, 255, (size,), dtype=torch.uint8)
    ack = torch.zeros(1, dtype=torch.uint8)
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        for off in range(0, size, chunk):
            dist.send(src[off : off + chunk], dst=1)
        dist.recv(ack, src=1)
        times.append(time.perf_counter() - start)
    dist.destroy_process_group()
    proc.join(timeout=30)
    return size / statistics.median(times[1:]) / 1e9


def reconstruction_rmse(wire: str, src_dtype: str) -> float:
    """Relative RMSE of sending this bench's KV as `wire` (one 8 MiB sample; 0 when lossless)."""
    if wire == src_dtype:
        return 0.0
    from sage_infer.transport.format.converter import reconstruction_error

    sample = kv_layers(8 << 20, TORCH_OF[src_dtype])[0]
    return reconstruction_error(sample.view(-1, HEAD_DIM), wire).rel_rmse


BASELINES = {"shm": memcpy_to_shm_gbps, "tcp": plain_socket_gbps, "torchdist": plain_dist_gbps}
BASELINE_NAMES = {"shm": "memcpy into shared memory", "tcp": "plain socket sendall/recv_into",
                  "torchdist": "plain dist.send/recv"}


def run_bench(backends, size: int, chunks, dtypes, *, src_dtype: str = "fp16", repeats: int = 4,
              threads: int = 1, zero_copy: str = "both", progress=None, checksum: str = "crc32c") -> list[BenchResult]:
    """`zero_copy`: off, on or both — applies to shm (the one backend that delivers into a
    registered shared arena); the others always run without."""
    results = []
    rel_rmse = {wire: reconstruction_rmse(wire, src_dtype) for wire in dtypes}
    for backend in backends:
        modes = {"off": [False], "on": [True], "both": [False, True]}[zero_copy] if backend == "shm" else [False]
        for chunk in chunks:
            baseline = BASELINES[backend](size, chunk, repeats)
            crc_baseline = memcpy_to_shm_gbps(size, chunk, repeats, crc=True) if backend == "shm" else 0.0
            kv = kv_layers(size, TORCH_OF[src_dtype]) if backend == "shm" else None
            kv_memcpy = memcpy_to_shm_gbps(size, chunk, repeats, layers=kv) if kv is not None else 0.0
            bounds = ({zc: shm_bound_gbps(kv, chunk, repeats, direct=zc) or 0.0 for zc in modes}
                      if kv is not None and checksum == "crc32c" else {})
            for wire in dtypes:
                for zc in modes:
                    if progress:
                        progress(f"{backend} chunk={chunk >> 10}KiB dtype={wire}" + (" zero-copy" if zc else ""))
                    r = run_transport(backend, size, chunk, wire, src_dtype, repeats, threads, zc, checksum)
                    results.append(BenchResult(
                        backend, chunk, wire, r["gbps"], baseline, r["gbps"] / baseline, r["p50_chunk_us"],
                        r["p99_chunk_us"], r["convert_share"], r["receiver_cpu_share"], r["wire_bytes"],
                        r["total_bytes"], r["retransmits"], zc, rel_rmse[wire], crc_baseline, kv_memcpy,
                        r["sender_cpu_us_per_chunk"], r["receiver_cpu_us_per_chunk"], 0.0, bounds.get(zc, 0.0),
                    ))  # fmt: skip
    as_stored = {(r.backend, r.chunk_bytes, r.zero_copy): r.gbps for r in results if r.dtype == src_dtype}
    for r in results:
        r.ratio_to_as_stored = r.gbps / as_stored.get((r.backend, r.chunk_bytes, r.zero_copy), math.inf)
    return results


def results_json(results: list[BenchResult]) -> dict:
    return {"results": [asdict(r) for r in results]}
