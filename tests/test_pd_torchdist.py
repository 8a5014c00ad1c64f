"""Prefill/decode KV over torchdist: the workers of a deployment form one gloo process group and a
decode worker's KV address is its rank.

- KV connectors in real processes (two prefill ranks, one decode rank) move several transfers each,
  concurrently on one channel per sender, bit-exact, and every process exits cleanly;
- `sage llm serve --pd 1P1D --kv-transport backend=torchdist` answers token for token like one
  engine, and both workers' metrics show the KV went over torchdist;
- what cannot work is one clear config error (exit 2) naming the field, never a hang.
"""

from __future__ import annotations

import hashlib
import json
import queue
import subprocess
import sys
import time

import httpx
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from prometheus_client.parser import text_string_to_metric_families

from sage_infer.config.transport import KVTransportConfig, ProcessGroupConfig
from sage_infer.core.kv_schema import KVCacheSchema, KVDtype
from sage_infer.errors import ConfigError
from sage_infer.hal.net import free_port
from sage_infer.router.launch import PDGroup, pd_group, worker_flags
from sage_infer.transport.process_group import exit_process, join_process_group
from tests.test_config_sections import build
from tests.test_pd_launch import run_deployment
from tests.tiny_models import make_tiny_model

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")

SCHEMA = KVCacheSchema(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16, dtype=KVDtype.BF16)  # 16 KiB/block
CHUNK = 40 * 1024  # two whole blocks per chunk, so a 5-block transfer is 3 chunks
TRANSFERS_PER_SENDER = 3
BLOCKS = 5
RUN_LIMIT_S = 120.0  # the "did not hang" bound of the whole run (a busy 2-core machine)


def rows_of(sender: int, index: int) -> torch.Tensor:
    """The KV rows sender `sender` sends as its transfer `index`: ``[BLOCKS, bytes_per_block]`` uint8."""
    gen = torch.Generator().manual_seed(1000 * sender + index)
    return torch.randint(0, 256, (BLOCKS, SCHEMA.bytes_per_block), generator=gen, dtype=torch.uint8)


def hashes_of(sender: int, index: int) -> list[bytes]:
    """The chained block hashes that travel with those rows (any 32 bytes: this receiver registers nothing)."""
    return [hashlib.sha256(f"{sender}-{index}-{b}".encode()).digest() for b in range(BLOCKS)]


def wait_for(poll, count: int, limit_s: float = 60.0) -> list:
    results, deadline = [], time.monotonic() + limit_s
    while len(results) < count and time.monotonic() < deadline:
        results += poll()
        time.sleep(0.01)
    return results


def _rank(rank: int, world: int, init_method: str, expecting, results) -> None:
    """Ranks 0..world-2 send (prefill), the last rank receives (decode); each reports one dict."""
    from sage_infer.kv_runtime.kv_pipe import KVPipe

    joined = join_process_group(ProcessGroupConfig(init_method=init_method, rank=rank, world_size=world,
                                                   timeout_s=60), torch.device("cpu"))
    config = KVTransportConfig(backend="torchdist", chunk_size=CHUNK, timeout_s=60)
    decode = rank == world - 1
    connector = KVPipe(SCHEMA, config, backend="torchdist", listen=decode)
    out: dict = {"rank": rank, "group": joined.backend, "address": connector.address}
    if decode:
        senders = range(world - 1)
        for sender in senders:
            for i in range(TRANSFERS_PER_SENDER):
                connector.expect(f"t-{sender}-{i}", BLOCKS, deadline_s=60)
        expecting.set()
        got = wait_for(connector.poll_received, (world - 1) * TRANSFERS_PER_SENDER)
        out["received"] = sorted(r.transfer_id for r in got if r.ok)
        out["errors"] = [r.error for r in got if not r.ok]
        out["bit_exact"] = all(torch.equal(r.rows, rows_of(*map(int, r.transfer_id.split("-")[1:])))
                               and list(r.block_hashes) == hashes_of(*map(int, r.transfer_id.split("-")[1:]))
                               for r in got if r.ok)
        out["dropped_chunks"] = connector.dropped_chunks
    else:
        expecting.wait(60)
        for i in range(TRANSFERS_PER_SENDER):  # all at once: they share this sender's one channel
            connector.start_send(f"t-{rank}-{i}", f"torchdist://{world - 1}", rows_of(rank, i), hashes_of(rank, i))
        got = wait_for(connector.poll_sent, TRANSFERS_PER_SENDER)
        out["sent"] = sorted(r.transfer_id for r in got if r.ok)
        out["errors"] = [r.error for r in got if not r.ok]
        out["bytes"] = sum(r.nbytes for r in got)
    results.put(out)
    results.close()
    results.join_thread()
    dist.barrier()  # nobody closes its connector while a peer may still be receiving
    connector.close()
    exit_process(0)  # as `sage llm serve` ends a worker that joined a group



@pytest.fixture(scope="module")
def two_prefill_one_decode() -> tuple[dict[int, dict], list[int | None]]:
    """Two sender ranks and one receiver rank in one gloo group: {rank: report}, exit codes."""
    world, ctx = 3, mp.get_context("spawn")
    results, expecting = ctx.Queue(), ctx.Event()
    init_method = f"tcp://127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=_rank, args=(r, world, init_method, expecting, results)) for r in range(world)]
    for proc in procs:
        proc.start()
    reports: dict[int, dict] = {}
    deadline = time.monotonic() + RUN_LIMIT_S
    try:
        while len(reports) < world and time.monotonic() < deadline:
            try:
                report = results.get(timeout=0.5)
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in procs):
                    break
                continue
            reports[report["rank"]] = report
        for proc in procs:
            proc.join(max(1.0, deadline - time.monotonic()))
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join(5)
    return reports, [p.exitcode for p in procs]


def test_two_prefill_ranks_send_concurrent_transfers_to_one_decode_rank_bit_exact(two_prefill_one_decode):
    reports, _ = two_prefill_one_decode
    assert sorted(reports) == [0, 1, 2], reports
    decode = reports[2]
    assert decode["group"] == "gloo" and decode["address"] == "torchdist://2"
    want = sorted(f"t-{s}-{i}" for s in (0, 1) for i in range(TRANSFERS_PER_SENDER))
    assert decode["errors"] == [] and decode["received"] == want
    assert decode["bit_exact"] and decode["dropped_chunks"] == 0
    for rank in (0, 1):
        sender = reports[rank]
        assert sender["errors"] == [] and sender["address"] is None
        assert sender["sent"] == [f"t-{rank}-{i}" for i in range(TRANSFERS_PER_SENDER)]
        assert sender["bytes"] == TRANSFERS_PER_SENDER * BLOCKS * (SCHEMA.bytes_per_block + 32)  # rows + hashes


def test_every_rank_closes_its_connector_and_exits_0(two_prefill_one_decode):
    _, exit_codes = two_prefill_one_decode
    assert exit_codes == [0, 0, 0]


# -- sage llm serve --pd 1P1D over torchdist -----------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("pd-torchdist") / "tiny", "llama")


def metrics(url: str) -> dict[tuple[str, tuple], float]:
    """A worker's /metrics: (sample name, sorted labels without the model) -> value."""
    out = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for sample in family.samples:
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "model_name"))
            out[(sample.name, labels)] = sample.value
    return out


def kv_went_over_torchdist(prefill: str, decode: str) -> None:
    sent, received = metrics(prefill), metrics(decode)
    assert sent[("sage:kv_transfer_bytes_total", (("backend", "torchdist"), ("direction", "send")))] > 0
    assert sent[("sage:pd_transfers_total", (("direction", "send"), ("outcome", "ok")))] == 1
    assert received[("sage:pd_transfers_total", (("direction", "receive"), ("outcome", "ok")))] == 1
    assert received[("sage:pd_transfers_total", (("direction", "receive"), ("outcome", "failed")))] == 0
    assert received[("sage:pd_transfer_bytes_total", (("direction", "receive"),))] == \
        sent[("sage:pd_transfer_bytes_total", (("direction", "send"),))] > 0


def test_pd_1p1d_over_torchdist_answers_like_one_engine(model_dir):
    output = run_deployment(model_dir, "--kv-transport", "backend=torchdist", check_workers=kv_went_over_torchdist)
    assert "rank 0 of 2 in a gloo process group at tcp://127.0.0.1:" in output  # the prefill worker
    assert "rank 1 of 2 in a gloo process group" in output and "receiving at torchdist://1" in output
    assert "terminate called" not in output and "Fatal Python error" not in output  # the workers ended cleanly


def test_pd_over_torchdist_with_the_ray_launcher(model_dir):
    pytest.importorskip("ray", reason="Ray is not installed (pip install 'sage-infer[ray]'): --launcher ray untested")
    run_deployment(model_dir, "--launcher", "ray", "--kv-transport", "backend=torchdist",
                   check_workers=kv_went_over_torchdist)


def test_pd_gives_prefill_workers_the_first_ranks_and_one_rendezvous():
    group = pd_group(ProcessGroupConfig(), 2, 2)
    assert group.world_size == 4 and group.init_method.startswith("tcp://127.0.0.1:")
    ranks = {f"{role}-{i}": group.rank(role, i) for role in ("prefill", "decode") for i in range(2)}
    assert ranks == {"prefill-0": 0, "prefill-1": 1, "decode-0": 2, "decode-1": 3}
    flags = worker_flags("decode", 1, None, group)
    assert flags == ["--set", "role=decode", "--set", f"kv_transport.process_group.init_method={group.init_method}",
                     "--set", "kv_transport.process_group.rank=3", "--set", "kv_transport.process_group.world_size=4"]
    chosen = pd_group(ProcessGroupConfig(init_method="tcp://127.0.0.1:29555"), 1, 1)
    assert chosen == PDGroup("tcp://127.0.0.1:29555", 2, 1)  # an init_method the user set is kept
    assert worker_flags("prefill", 0, None, None) == ["--set", "role=prefill"]  # other backends: no group


# -- what cannot work: one line, exit 2, naming the field ------------------------------------------


def test_a_torchdist_worker_without_its_group_is_a_config_error(model_dir):
    with pytest.raises(ConfigError, match=r"kv_transport\.process_group\.init_method: backend torchdist joins"):
        build(model_dir, "kv_pool.num_blocks=8", "role=decode", "kv_transport.backend=torchdist")
    with pytest.raises(ConfigError, match=r"kv_transport\.process_group\.rank: 2 is not a rank of a group of "
                                          r"world_size 2"):
        build(model_dir, "kv_pool.num_blocks=8", "role=prefill", "kv_transport.backend=torchdist",
              "kv_transport.process_group.init_method=tcp://127.0.0.1:1", "kv_transport.process_group.rank=2",
              "kv_transport.process_group.world_size=2")
    assert not dist.is_initialized()


def test_nccl_refuses_more_than_one_prefill_decode_pair_before_joining():
    config = ProcessGroupConfig(init_method="tcp://127.0.0.1:1", rank=0, world_size=3)
    with pytest.raises(ConfigError, match=r"kv_transport\.process_group\.world_size: over nccl a decode worker "
                                          "cannot receive from any rank"):
        join_process_group(config, torch.device("cuda"))  # refused before anything touches CUDA or the network
    assert not dist.is_initialized()


def test_a_group_that_never_fills_up_stops_the_worker_at_its_timeout(model_dir):
    """Rank 0 of 2 waits for a rank 1 that never starts: exit 2 with one line, not a hang."""
    port = free_port()
    result = subprocess.run(
        [sys.executable, "-m", "sage_infer.cli.main", "llm", "serve", "--role", "decode", "--port", "0",
         "--model", str(model_dir), "--set", "kv_pool.num_blocks=8",
         "--kv-transport", f"backend=torchdist,process-group.init-method=tcp://127.0.0.1:{port}",
         "--kv-transport", "process-group.rank=0,process-group.world-size=2,process-group.timeout-s=1"],
        capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    [line] = [line for line in result.stderr.splitlines() if line.startswith("sage: error")]
    assert "kv_transport.process_group: rank 0 of 2 could not join the gloo group" in line
    assert f"tcp://127.0.0.1:{port} within 1 s" in line and "Traceback" not in result.stderr


def test_pd_flag_mistakes_with_torchdist_are_one_line_exit_2(sage):
    result = sage("llm", "serve", "--pd", "1P1D", "--kv-transport", "backend=torchdist,process-group.rank=0")
    assert result.code == 2 and "kv_transport.process_group.rank: --pd assigns every worker its rank" in result.err
    result = sage("llm", "serve", "--pd", "1P1D", "--launcher", "ray", "--host", "0.0.0.0",
                  "--kv-transport", "backend=torchdist")
    assert result.code == 2 and "torchdist with --launcher ray across nodes is not supported yet" in result.err
    result = sage("config", "show", "--kv-transport", "process-group.init-method=127.0.0.1:29500")
    assert result.code == 2 and "kv_transport.process_group.init_method" in result.err
    result = sage("config", "show", "--kv-transport", "process-group.port=1")
    assert result.code == 2 and "expected in process-group one of: init-method, rank" in result.err


def test_config_show_marks_the_process_group_active_only_for_torchdist(sage):
    def rows(*flags: str) -> dict[str, dict]:
        result = sage("config", "show", "--preset", "cpu", "--json", *flags)
        assert result.code == 0, result.err
        return {r["field"]: r for r in json.loads(result.out)["fields"]}

    tcp = rows("--set", "role=decode", "--kv-transport", "backend=tcp")
    assert tcp["kv_transport.process_group.init_method"]["active"] is False
    assert "kv_transport.backend=torchdist" in tcp["kv_transport.process_group.init_method"]["inactive_reason"]
    worker = rows("--set", "role=decode", "--kv-transport", "backend=torchdist,process-group.rank=1")
    assert all(worker[f"kv_transport.process_group.{name}"]["active"]
               for name in ("init_method", "rank", "world_size", "timeout_s"))
    assert worker["kv_transport.process_group.rank"]["value"] == 1
    deployment = rows("--set", "pd=1P1D", "--kv-transport", "backend=torchdist")
    assert deployment["kv_transport.process_group.init_method"]["active"] is True  # kept by --pd when set
    assert deployment["kv_transport.process_group.rank"]["active"] is False
    assert "--pd gives each worker its rank" in deployment["kv_transport.process_group.rank"]["inactive_reason"]
