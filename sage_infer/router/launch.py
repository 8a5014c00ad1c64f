"""`sage llm serve --pd xPyD`: x prefill and y decode workers on this host, behind one router URL.

Each worker is its own `sage llm serve --role prefill|decode --port 0` process, started with
the same model and config flags as the command; its ready line gives its URL. The router then
listens on the command's host and port and prints one URL. Stopping the command (SIGINT or
SIGTERM) stops the router, then the workers. With ``kv_transport.backend: torchdist`` the workers
form one process group: ranks 0..x-1 are the prefill workers, x..x+y-1 the decode workers, and
they meet at ``kv_transport.process_group.init_method`` (a free 127.0.0.1 port unless set).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from sage_infer.config.serve import RouterConfig
from sage_infer.config.transport import ProcessGroupConfig
from sage_infer.errors import ConfigError, UsageError
from sage_infer.hal.net import free_port
from sage_infer.router.instances import Instances

READY = re.compile(r"serving (\S+) at (http://\S+)/v1")
LOOPBACK = ("127.0.0.1", "localhost", "::1")
WORKER_START_S = 300.0  # loading a model can take a while on a busy machine


def parse_pd(spec: str) -> tuple[int, int]:
    """``1P1D`` -> (1, 1); ``2p3d`` -> (2, 3)."""
    match = re.fullmatch(r"(\d+)[pP](\d+)[dD]", spec.strip())
    if match is None or int(match.group(1)) < 1 or int(match.group(2)) < 1:
        raise UsageError(f"--pd {spec!r}: expected xPyD with x, y >= 1, e.g. 1P1D or 2P1D")
    return int(match.group(1)), int(match.group(2))


@dataclass
class Worker:
    role: str
    index: int
    process: subprocess.Popen
    url: str | None = None
    model: str | None = None
    ready: threading.Event = field(default_factory=threading.Event)
    cpus: list[int] | None = None  # the cores it is pinned to (None: not pinned)
    args: list[str] = field(default_factory=list)  # its `sage llm serve` flags, to start it again as it was

    @property
    def name(self) -> str:
        return f"{self.role}-{self.index}"

    def pump(self) -> None:
        """Forward the worker's output, prefixed; note its URL when it says it is ready."""
        for line in self.process.stdout:
            match = READY.search(line)
            if match and not self.ready.is_set():
                self.model, self.url = match.group(1), match.group(2)
                self.ready.set()
            print(f"[{self.name}] {line}", end="", file=sys.stderr, flush=True)
        self.ready.set()  # it exited: whoever waits finds no url


@dataclass(frozen=True, slots=True)
class PDGroup:
    """The torchdist process group of one deployment: where its ranks meet and how many there are."""

    init_method: str
    world_size: int
    num_prefill: int

    def rank(self, role: str, index: int) -> int:
        return index if role == "prefill" else self.num_prefill + index


def pd_group(config: ProcessGroupConfig, num_prefill: int, num_decode: int, launcher: str = "local",
             host: str = "127.0.0.1") -> PDGroup:
    """The group `--pd` gives its workers for ``kv_transport.backend: torchdist``; ConfigError for what it
    cannot do (ranks set by hand, Ray workers that may sit on other nodes)."""
    for name in ("rank", "world_size"):
        if getattr(config, name) is not None:
            raise ConfigError(f"kv_transport.process_group.{name}: --pd assigns every worker its rank and the "
                              "world size; leave it out")
    if launcher == "ray" and host not in LOOPBACK:
        raise ConfigError("kv_transport.backend: torchdist with --launcher ray across nodes is not supported yet "
                          "(the group's rendezvous would have to be on rank 0's node); use tcp, or bind loopback")
    init_method = config.init_method or f"tcp://127.0.0.1:{free_port()}"
    return PDGroup(init_method, num_prefill + num_decode, num_prefill)


def worker_flags(role: str, index: int, disk_path: str | None, group: PDGroup | None) -> list[str]:
    """The flags that make a worker `role`-`index` of this deployment (after the command's own)."""
    flags = ["--set", f"role={role}"] if role in ("prefill", "decode") else []  # a replica runs both
    if disk_path is not None:  # one disk tier directory per worker: they must not share segment files
        flags += ["--set", f"tiers.disk_path={disk_path.rstrip('/')}/{role}-{index}"]
    if group is not None:
        for name, value in (("init_method", group.init_method), ("rank", group.rank(role, index)),
                            ("world_size", group.world_size)):
            flags += ["--set", f"kv_transport.process_group.{name}={value}"]
    return flags


def start_workers(num_prefill: int, num_decode: int, worker_args: list[str], disk_path: str | None,
                  group: PDGroup | None = None) -> list[Worker]:
    """Start the workers and wait until each says it is serving; ConfigError if one does not."""
    workers = [spawn_worker(role, i, [*worker_args, *worker_flags(role, i, disk_path, group)])
               for role, count in (("prefill", num_prefill), ("decode", num_decode)) for i in range(count)]
    wait_ready(workers, "--pd")
    return workers


def spawn_worker(role: str, index: int, args: list[str], cpus: list[int] | None = None, port: int = 0) -> Worker:
    """One `sage llm serve ARGS` on loopback `port` (0: a free one); `cpus`: the cores it runs on (its threads,
    one per core), else all of this process's."""
    env = None
    preexec = None
    if cpus:
        env = {**os.environ, "OMP_NUM_THREADS": str(len(cpus))}
        preexec = lambda: os.sched_setaffinity(0, cpus)  # noqa: E731 - in the child, before it execs
    process = subprocess.Popen([sys.executable, "-m", "sage_infer.cli.main", "llm", "serve", *args,
                                "--host", "127.0.0.1", "--port", str(port)],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1, env=env,
                               preexec_fn=preexec)
    worker = Worker(role, index, process, cpus=cpus, args=args)
    threading.Thread(target=worker.pump, name=f"sage-{worker.name}", daemon=True).start()
    return worker


def wait_ready(workers: list[Worker], flag: str) -> None:
    """Until each worker says it is serving; ConfigError naming the first that does not (all are stopped)."""
    deadline = time.monotonic() + WORKER_START_S
    for worker in workers:
        worker.ready.wait(max(0.0, deadline - time.monotonic()))
        if worker.url is None:
            stop_workers(workers)
            code = worker.process.poll()
            raise ConfigError(f"{flag}: the {worker.name} worker did not start"
                              + (f" (exit code {code}; its output is above)" if code is not None else ""))


def stop_workers(workers: list[Worker], timeout: float = 20.0) -> None:
    for worker in workers:
        if worker.process.poll() is None:
            worker.process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for worker in workers:
        try:
            worker.process.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            worker.process.kill()


def serve_pd(spec: str, worker_args: list[str], host: str, port: int, api_key: str | None,
             disk_path: str | None = None, router: RouterConfig | None = None, launcher: str = "local",
             ray_address: str | None = None, process_group: ProcessGroupConfig | None = None,
             secrets: dict[str, str] | None = None, routing: str = "kv", model_path: str | None = None) -> int:
    """Run the deployment until SIGINT/SIGTERM; exit code 0. `launcher`: local (subprocesses of this
    command, which inherit its environment) or ray (Ray actors, see `router.ray_launch`, whose workers
    get `secrets` as environment variables). `process_group`: the workers' torchdist group settings
    (None: their KV goes over another backend). `routing` chooses among the prefill workers, hashing prompts with
    the tokenizer of `model_path` (None: the demo)."""
    num_prefill, num_decode = parse_pd(spec)
    if launcher not in ("local", "ray"):
        raise UsageError(f"--launcher {launcher}: expected local or ray")
    group = None if process_group is None else pd_group(process_group, num_prefill, num_decode, launcher, host)
    from sage_infer.router.supervise import Supervisor

    if launcher == "ray":
        from sage_infer.router.ray_launch import RayLauncher

        ray_launcher = RayLauncher(ray_address)
        if num_prefill + num_decode > (cpus := ray_launcher.cpus()):
            ray_launcher.stop()
            raise UsageError(f"--pd {spec}: {num_prefill + num_decode} workers, and the Ray cluster has {cpus} "
                             "CPUs, one at least per worker")
        workers = ray_launcher.start(num_prefill, num_decode, worker_args, disk_path, host, group, secrets)
        stop = ray_launcher.stop
    else:
        if num_prefill + num_decode > (cores := len(os.sched_getaffinity(0))):
            raise UsageError(f"--pd {spec}: {num_prefill + num_decode} workers, and this machine gives {cores} "
                             "cores, one at least per worker (fewer workers, or place them on a Ray cluster)")
        workers = start_workers(num_prefill, num_decode, worker_args, disk_path, group)
        # a worker that dies is started again at the same URL, except in a torchdist group it could not rejoin
        supervisor = Supervisor(workers).start() if group is None else None

        def stop() -> None:
            if supervisor is not None:
                supervisor.stop()
            stop_workers(workers)
    def announce(bound: int) -> str:
        return (f"sage_infer serving {workers[0].model} at http://{host}:{bound}/v1 ({num_prefill} prefill + "
                f"{num_decode} decode workers: {', '.join(f'{w.name} {w.url}' for w in workers)})")

    try:
        return serve_router([w.url for w in workers if w.role == "prefill"],
                            [w.url for w in workers if w.role == "decode"], host, port, api_key, router,
                            announce, routing, model_path)
    finally:
        stop()


def serve_router(prefill_urls: list[str], decode_urls: list[str], host: str, port: int, api_key: str | None,
                 router: RouterConfig | None = None, announce=None, routing: str = "kv",
                 model_path: str | None = None, local_tokenizer: bool = True) -> int:
    """Run the router over running workers until SIGINT/SIGTERM; exit code 0. The workers may be sage servers
    (``--role prefill|decode``) or any server speaking vLLM's ``kv_transfer_params`` (vLLM with a P/D connector,
    e.g. SageKVConnector as kv_producer / kv_consumer). `routing` chooses among the prefill workers; with
    `local_tokenizer`, kv routing hashes prompts with the tokenizer of `model_path` (None: the demo)."""
    from sage_infer.router.app import build_router
    from sage_infer.router.local_prompts import local_prompts
    from sage_infer.server.launch import http_server, run_announced

    prompts = local_prompts(model_path) if local_tokenizer and routing == "kv" and len(prefill_urls) > 1 else None
    app = build_router(Instances.of(prefill_urls, decode_urls), api_key, router, routing, prompts)
    server = http_server(app, host, port)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: setattr(server, "should_exit", True))
    return run_announced(server, host, port, announce or (lambda bound: (
        f"sage_infer router at http://{host}:{bound}/v1 (prefill: {', '.join(prefill_urls) or 'none'}; "
        f"decode: {', '.join(decode_urls)})")))
