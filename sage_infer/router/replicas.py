"""`sage llm serve --replicas N` and `sage llm router --replica URL ...`: a fleet of whole-model replicas behind
the KV-aware fleet router (`router.fleet`).

`--replicas N` starts N `sage llm serve` processes on this host with the command's model and config
flags, each pinned to its own share of the cores (split NUMA node by NUMA node, so a replica's share
stays within one node where the shares allow), then the router on the command's host and port,
which prints one URL. A replica that dies is started again at the same URL (`router.supervise`).
Stopping the command (SIGINT or SIGTERM) stops the router, then the replicas.
"""

from __future__ import annotations

import os
import signal
import sys

import httpx

from sage_infer.errors import NotAvailableError, UsageError
from sage_infer.hal.cpu import read_numa_nodes
from sage_infer.kv_policy.routing import ROUTING_POLICIES
from sage_infer.router.launch import spawn_worker, stop_workers, wait_ready, worker_flags
from sage_infer.router.supervise import Supervisor

MAX_REPLICAS = 256
PROBE_TIMEOUT_S = 5.0


def check_routing(routing: str) -> str:
    if routing not in ROUTING_POLICIES:
        raise UsageError(f"--routing {routing}: expected one of {', '.join(ROUTING_POLICIES)}")
    return routing


def split_cores(n: int, cpus: list[int] | None = None, numa: dict[int, int] | None = None) -> list[list[int]]:
    """`n` disjoint, near-equal shares of `cpus` (default: the cores this process may run on), each a contiguous
    run in NUMA-node order (`numa`: cpu -> node; default read from sysfs). UsageError when `n` is out of range."""
    cpus = sorted(os.sched_getaffinity(0)) if cpus is None else list(cpus)
    if numa is None:
        numa = {cpu: node.node for node in read_numa_nodes() for cpu in node.cpus}
    if not 1 <= n <= MAX_REPLICAS:
        raise UsageError(f"--replicas {n}: expected 1-{MAX_REPLICAS}")
    if n > len(cpus):
        raise UsageError(f"--replicas {n}: this machine gives {len(cpus)} cores, one at least per replica "
                         f"(fewer replicas, or place them on a Ray cluster)")
    ordered = sorted(cpus, key=lambda cpu: (numa.get(cpu, 0), cpu))
    base, extra = divmod(len(ordered), n)
    shares, start = [], 0
    for i in range(n):
        size = base + (1 if i < extra else 0)
        shares.append(ordered[start:start + size])
        start += size
    return shares


def describe_split(shares: list[list[int]], numa: dict[int, int] | None = None) -> str:
    numa = numa if numa is not None else {cpu: node.node for node in read_numa_nodes() for cpu in node.cpus}
    parts = []
    for i, share in enumerate(shares):
        nodes = sorted({numa.get(cpu, 0) for cpu in share})
        parts.append(f"replica-{i}: cores {_cpu_list(share)} (NUMA node {','.join(map(str, nodes))})")
    return "; ".join(parts)


def _cpu_list(cpus: list[int]) -> str:
    runs, start = [], None
    for i, cpu in enumerate(cpus):
        if start is None:
            start = cpu
        if i + 1 == len(cpus) or cpus[i + 1] != cpu + 1:
            runs.append(str(start) if start == cpu else f"{start}-{cpu}")
            start = None
    return ",".join(runs)


def serve_replicas(n: int, worker_args: list[str], host: str, port: int, api_key: str | None,
                   routing: str = "kv", disk_path: str | None = None, launcher: str = "local",
                   ray_address: str | None = None, secrets: dict[str, str] | None = None,
                   model_path: str | None = None) -> int:
    """Run N replicas and the fleet router until SIGINT/SIGTERM; exit code 0. `launcher`: local (processes of this
    command, pinned to core shares) or ray (restartable Ray actors, `router.ray_launch.RayReplicas`); `model_path`:
    the replicas' model (None: the demo), whose tokenizer the router uses to hash prompts itself."""
    check_routing(routing)
    if launcher == "ray":
        from sage_infer.router.ray_launch import RayReplicas

        ray_replicas = RayReplicas(ray_address)
        cpus = ray_replicas.cpus()
        if not 1 <= n <= min(cpus, MAX_REPLICAS):
            ray_replicas.stop()
            raise UsageError(f"--replicas {n}: the Ray cluster has {cpus} CPUs, one at least per replica")
        print(f"sage: --replicas {n} on Ray: {cpus // n} CPU(s) each of the cluster's {cpus}", file=sys.stderr,
              flush=True)
        workers = ray_replicas.start(n, cpus // n, worker_args, disk_path, host, secrets)
        stop = ray_replicas.stop
    else:
        shares = split_cores(n)
        print(f"sage: --replicas {n}: {describe_split(shares)}", file=sys.stderr, flush=True)
        workers = [spawn_worker("replica", i, [*worker_args, *worker_flags("replica", i, disk_path, None)], share)
                   for i, share in enumerate(shares)]
        wait_ready(workers, "--replicas")
        supervisor = Supervisor(workers).start()  # a replica that dies is started again, at the same URL

        def stop() -> None:
            supervisor.stop()
            stop_workers(workers)
    try:
        return serve_fleet([w.url for w in workers], host, port, api_key, routing, model_path=model_path,
                           announce=lambda bound: (f"sage_infer serving {workers[0].model} at http://{host}:{bound}/v1 "
                                          f"({n} replicas, routing {routing}: "
                                          f"{', '.join(f'{w.name} {w.url}' for w in workers)})"))
    finally:
        stop()


def probe_replicas(urls: list[str], api_key: str | None) -> None:
    """Each URL answers /v1/models now (UsageError naming the first that does not): a typo fails at start-up."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    for url in urls:
        try:
            reply = httpx.get(f"{url.rstrip('/')}/v1/models", headers=headers, timeout=PROBE_TIMEOUT_S)
        except httpx.HTTPError as err:
            raise UsageError(f"--replica {url}: does not answer ({err or type(err).__name__})") from None
        if reply.status_code != 200:
            raise UsageError(f"--replica {url}: /v1/models answered HTTP {reply.status_code}")


def serve_fleet(urls: list[str], host: str, port: int, api_key: str | None, routing: str = "kv",
                announce=None, vllm_events: dict | None = None, model_path: str | None = None,
                local_tokenizer: bool = True) -> int:
    """Run the fleet router over running replicas until SIGINT/SIGTERM; exit code 0. `vllm_events`: replica URL ->
    `router.vllm_events.VllmEndpoints` of a vLLM server publishing its KV events; `model_path` (None: the demo)
    and `local_tokenizer`: the router tokenizes text prompts for kv routing itself with that model's tokenizer."""
    from sage_infer.router.fleet import FleetRouter, build_fleet_app
    from sage_infer.router.local_prompts import local_prompts
    from sage_infer.router.vllm_events import events_missing
    from sage_infer.server.launch import http_server, run_announced

    if vllm_events and (why := events_missing()) is not None:
        raise NotAvailableError(why)
    prompts = local_prompts(model_path) if local_tokenizer and routing == "kv" else None
    app = build_fleet_app(FleetRouter(urls, check_routing(routing), api_key, vllm_events=vllm_events,
                                      prompts=prompts))
    server = http_server(app, host, port)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: setattr(server, "should_exit", True))
    return run_announced(server, host, port, announce or (lambda bound: (
        f"sage_infer router at http://{host}:{bound}/v1 (routing {routing}; replicas: {', '.join(urls)})")))
