"""The torchdist transport backend between two real processes in a gloo process group.

Rank 0 sends, rank 1 receives. Each scenario runs in two spawned children; every child reports
one result through a queue and then waits for the parent to release it, so a peer never
disappears before the other side has seen the behaviour under test (except where it must).
"""

from __future__ import annotations

import asyncio
import os
import queue
import signal
import socket
import time
from dataclasses import replace
from datetime import timedelta
from functools import partial

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from sage_infer.transport.backends.torchdist import TorchDistBackend, TorchDistSendChannel
from sage_infer.transport.base import get_backend
from sage_infer.transport.transport_errors import TransportError
from sage_infer.transport.wire import ChunkHeader, Flag, Kind, checksum

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")

CHUNK = 48 * 1024  # not a divisor of the KV sizes, so the last chunk of each layer is short
DONT_HANG_S = 30.0  # the "did not hang" bound for a whole run of scenarios
SCENARIO_LIMIT_S = 8.0  # one scenario past this is reported as hung


# -- KV data both sides can rebuild -------------------------------------------------------


def kv_layers() -> list[torch.Tensor]:
    """Two layers of K/V cache, `[2, num_tokens, num_kv_heads, head_dim]`, one fp16 and one bf16."""
    gen = torch.Generator().manual_seed(1234)
    shape = (2, 61, 8, 128)
    return [torch.randn(shape, generator=gen).to(torch.float16), torch.randn(shape, generator=gen).to(torch.bfloat16)]


def kv_chunks(layers: list[torch.Tensor]) -> list[tuple[ChunkHeader, memoryview]]:
    """Each layer's bytes split into CHUNK-sized pieces, with headers numbered across the transfer."""
    pieces = []
    for layer, kv in enumerate(layers):
        raw = memoryview(kv.view(torch.uint8).numpy()).cast("B")
        pieces += [
            (layer, index, offset, raw[offset : offset + CHUNK])
            for index, offset in enumerate(range(0, raw.nbytes, CHUNK))
        ]
    chunks = []
    for seq, (layer, index, offset, view) in enumerate(pieces):
        dtype = ("fp16", "bf16")[layer]
        header = ChunkHeader(
            Kind.DATA, "req-kv", seq=seq, layer=layer, chunk_index=index, offset=offset, count=len(pieces)
        )
        chunks.append(
            (replace(header, length=view.nbytes, raw_length=view.nbytes, src_dtype=dtype, crc=checksum(view)), view)
        )
    return chunks


class KVSink:
    """Receives the chunks straight into empty KV tensors shaped like the sender's."""

    def __init__(self) -> None:
        self.layers = [torch.empty_like(kv) for kv in kv_layers()]
        self.raw = [memoryview(kv.view(torch.uint8).numpy()).cast("B") for kv in self.layers]

    def __call__(self, header: ChunkHeader) -> memoryview:
        return self.raw[header.layer][header.offset : header.offset + header.length]

    def bit_exact(self) -> bool:
        return all(
            torch.equal(got.view(torch.uint8), want.view(torch.uint8)) for got, want in zip(self.layers, kv_layers())
        )


# -- senders and receivers (run in the children) --------------------------------------------


class CorruptFirstTry(TorchDistSendChannel):
    """Flips one payload byte of chunk 3's first transmission; the resend is clean."""

    async def _transmit(self, header: ChunkHeader, payload: memoryview, deadline: float) -> None:
        if header.kind is Kind.DATA and header.seq == 3 and not header.flags & Flag.RETRY:
            payload = _flipped(payload)
        await super()._transmit(header, payload, deadline)


class CorruptAlways(TorchDistSendChannel):
    """Flips one payload byte of chunk 2 on every transmission."""

    async def _transmit(self, header: ChunkHeader, payload: memoryview, deadline: float) -> None:
        if header.kind is Kind.DATA and header.seq == 2:
            payload = _flipped(payload)
        await super()._transmit(header, payload, deadline)


def _flipped(payload: memoryview) -> memoryview:
    copy = bytearray(payload)
    copy[len(copy) // 2] ^= 0x40
    return memoryview(copy)


def _deadline(seconds: float) -> float:
    return asyncio.get_running_loop().time() + seconds


async def send_kv(peer_done, channel_type=TorchDistSendChannel, *, stop_after=None, pause_s=0.0, abort_after=None):
    backend = TorchDistBackend()
    backend.send_channel = channel_type
    channel = await backend.connect("torchdist://1", max_inflight=4, max_retries=2, timeout_s=10)
    deadline = _deadline(15)
    chunks = kv_chunks(kv_layers())
    for i, (header, view) in enumerate(chunks):
        if i == abort_after:
            await channel.drain(deadline)
            await channel.abort("req-kv", "test gives up")
            await peer_done()
            return {"aborted": True}
        if i == stop_after:
            await channel.drain(deadline)
            if not pause_s:
                await peer_done()  # stalls for good
                return {"stalled": True}
            await asyncio.sleep(pause_s)
        await channel.send(header, view, deadline)
    await channel.drain(deadline)
    await channel.aclose()
    return {"retransmits": channel.retransmits, "chunks": len(chunks)}


async def recv_kv(peer_done, *, timeout_s: float = 15, kill_after=None) -> dict:
    listener = await TorchDistBackend().listen("torchdist://0")
    channel = await listener.accept(_deadline(10))
    sink, verified = KVSink(), []
    deadline = _deadline(timeout_s)
    while (header := await channel.recv(sink, deadline)) is not None:
        verified.append(header.seq)
        if len(verified) == kill_after:
            os.kill(os.getpid(), signal.SIGKILL)
    await channel.aclose()
    return {"verified": verified, "bit_exact": sink.bit_exact(), "checksum_failures": channel.checksum_failures}


async def recv_resuming_after_timeout(peer_done) -> dict:
    """Times out while the sender pauses, then receives the rest on the same channel."""
    channel = await (await TorchDistBackend().listen()).accept(_deadline(10))
    sink, verified, timeout = KVSink(), [], None
    try:
        while (header := await channel.recv(sink, _deadline(0.7))) is not None:
            verified.append(header.seq)
    except TransportError as err:
        timeout = type(err).__name__
    verified_before = list(verified)
    while (header := await channel.recv(sink, _deadline(15))) is not None:
        verified.append(header.seq)
    return {"timeout": timeout, "before": verified_before, "verified": verified, "bit_exact": sink.bit_exact()}


async def send_two_then_drain_briefly(peer_done) -> dict:
    channel = await TorchDistBackend().connect("torchdist://1", timeout_s=10)
    for header, view in kv_chunks(kv_layers())[:2]:
        await channel.send(header, view, _deadline(5))
    await channel.drain(_deadline(1.0))
    return {}


async def accept_and_stall(peer_done) -> dict:
    await (await TorchDistBackend().listen("torchdist://0")).accept(_deadline(10))
    await peer_done()  # never receives
    return {"stalled": True}


# Scenario name -> (rank 0 = sender, rank 1 = receiver). One process group runs them one after
# another, each on its own channel: a failed channel must not disturb the next.
SCENARIOS = {
    "bit_exact": (send_kv, recv_kv),
    "corrupt_once": (partial(send_kv, channel_type=CorruptFirstTry), recv_kv),
    "corrupt_always": (partial(send_kv, channel_type=CorruptAlways), recv_kv),
    "abort": (partial(send_kv, abort_after=4), recv_kv),
    "stalled_receiver": (send_two_then_drain_briefly, accept_and_stall),
    "stalled_sender": (partial(send_kv, stop_after=5), partial(recv_kv, timeout_s=1.0)),
    "paused_sender": (partial(send_kv, stop_after=5, pause_s=1.5), recv_resuming_after_timeout),
    "bit_exact_again": (send_kv, recv_kv),
    "killed_receiver": (send_kv, partial(recv_kv, kill_after=2)),  # breaks the group: run it on its own
}
SEQUENCE = [name for name in SCENARIOS if name != "killed_receiver"]


def _child(rank: int, port: int, scenarios: list[str], results, finished) -> None:
    """Run `scenarios` in order as `rank`; report each result, then park until the parent is done."""
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=timedelta(seconds=30)
    )

    async def run(name: str) -> dict:
        async def peer_done() -> None:
            while not finished[name][1 - rank].is_set():
                await asyncio.sleep(0.02)

        try:
            return await asyncio.wait_for(SCENARIOS[name][rank](peer_done), SCENARIO_LIMIT_S)
        except asyncio.TimeoutError:
            return {"error": "hung", "message": f"still running after {SCENARIO_LIMIT_S} s"}
        except Exception as err:  # noqa: BLE001  (reported to the parent)
            return {"error": type(err).__name__, "message": str(err)}

    for name in scenarios:
        start = time.monotonic()
        out = asyncio.run(run(name))
        out["elapsed_s"] = time.monotonic() - start
        results.put((name, rank, out))
        finished[name][rank].set()
    results.close()
    results.join_thread()
    finished["all"][1 - rank].wait(DONT_HANG_S)  # the peer may still need us
    os._exit(0)  # skip interpreter teardown: the gloo works a failure scenario leaves posted die with us


def run_pair(scenarios: list[str], expect: dict[str, tuple[int, ...]] | None = None) -> dict[str, dict[int, dict]]:
    """Run `scenarios` in two fresh processes; {scenario: {rank: result}} for the ranks expected to report."""
    expect = expect or {name: (0, 1) for name in scenarios}
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    finished = {name: (ctx.Event(), ctx.Event()) for name in [*scenarios, "all"]}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_child, args=(r, port, scenarios, results, finished), daemon=True) for r in (0, 1)]
    for p in procs:
        p.start()
    out: dict[str, dict[int, dict]] = {name: {} for name in scenarios}
    missing = lambda: {(n, r) for n, ranks in expect.items() for r in ranks if r not in out[n]}  # noqa: E731
    give_up = time.monotonic() + DONT_HANG_S
    try:
        while missing() and time.monotonic() < give_up:
            try:
                name, rank, result = results.get(timeout=0.2)
                out[name][rank] = result
            except queue.Empty:
                continue
    finally:
        for event in finished["all"]:
            event.set()
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)
    assert not missing(), f"hung: {sorted(missing())}; got {out}"
    return out


@pytest.fixture(scope="module")
def sequence() -> dict[str, dict[int, dict]]:
    """The results of every scenario but the killed receiver, run in one process group."""
    return run_pair(SEQUENCE)


# -- the behaviours ---------------------------------------------------------------------------


def test_fp16_and_bf16_kv_arrive_bit_exact(sequence):
    sender, receiver = sequence["bit_exact"][0], sequence["bit_exact"][1]
    assert "error" not in sender and "error" not in receiver, (sender, receiver)
    assert receiver["bit_exact"]
    assert receiver["verified"] == list(range(sender["chunks"]))
    assert sender["retransmits"] == 0 and receiver["checksum_failures"] == 0


def test_chunk_corrupted_once_is_resent_and_arrives_bit_exact(sequence):
    sender, receiver = sequence["corrupt_once"][0], sequence["corrupt_once"][1]
    assert "error" not in sender and "error" not in receiver, (sender, receiver)
    assert sender["retransmits"] == 1
    assert receiver["checksum_failures"] == 1
    assert receiver["bit_exact"]
    assert sorted(receiver["verified"]) == list(range(sender["chunks"]))


def test_chunk_corrupt_every_time_fails_both_sides_with_checksum_error(sequence):
    sender, receiver = sequence["corrupt_always"][0], sequence["corrupt_always"][1]
    assert sender["error"] == "ChecksumError", sender
    assert receiver["error"] == "ChecksumError", receiver


def test_abort_fails_the_receiver_naming_the_request(sequence):
    receiver = sequence["abort"][1]
    assert receiver["error"] == "TransportError", receiver
    assert "req-kv" in receiver["message"]


def test_stalled_receiver_times_out_the_senders_drain(sequence):
    sender = sequence["stalled_receiver"][0]
    assert sender["error"] == "TransferTimeout", sender


def test_sender_stopping_halfway_times_out_the_receiver(sequence):
    receiver = sequence["stalled_sender"][1]
    assert receiver["error"] == "TransferTimeout", receiver
    assert "rank 0" in receiver["message"]


def test_receiver_timed_out_between_chunks_resumes_when_the_sender_does(sequence):
    sender, receiver = sequence["paused_sender"][0], sequence["paused_sender"][1]
    assert "error" not in sender and "error" not in receiver, (sender, receiver)
    assert receiver["timeout"] == "TransferTimeout"
    assert receiver["before"] == list(range(5))
    assert receiver["verified"] == list(range(sender["chunks"])) and receiver["bit_exact"]


def test_failed_channels_do_not_disturb_a_new_one_in_the_same_group(sequence):
    sender, receiver = sequence["bit_exact_again"][0], sequence["bit_exact_again"][1]
    assert "error" not in sender and "error" not in receiver, (sender, receiver)
    assert receiver["bit_exact"] and receiver["verified"] == list(range(sender["chunks"]))


def test_killed_receiver_fails_the_sender_instead_of_hanging():
    sender = run_pair(["killed_receiver"], expect={"killed_receiver": (0,)})["killed_receiver"][0]
    assert sender["error"] in ("PeerClosedError", "TransportError"), sender
    assert sender["elapsed_s"] < 8, sender  # its deadline is 15 s: the death was noticed, not waited out


def test_connect_and_listen_without_a_process_group_raise_a_clear_error():
    assert not dist.is_initialized()
    backend = get_backend("torchdist")
    with pytest.raises(TransportError, match="init_process_group"):
        asyncio.run(backend.connect("torchdist://1"))
    with pytest.raises(TransportError, match="init_process_group"):
        asyncio.run(backend.listen("torchdist://0"))


def test_availability_says_a_process_group_is_needed():
    status = TorchDistBackend.availability()
    assert status.available
    assert "process group" in status.reason
