"""`sage llm serve --pd xPyD --launcher ray`: the workers as Ray actors, placed by Ray's scheduler.

Ray (``pip install 'sage-infer[ray]'``) places one actor per worker on its cluster (a local
instance unless `--ray-address` names one); each actor runs that worker's `sage llm serve
--role ...` as its own process and hands back the worker's URL. The router stays in the
command's process and prints the one URL. Workers bind loopback, like every sage server,
unless the command itself binds a non-loopback address (an explicit choice to be reachable):
then they bind all interfaces of their node and report its IP. Stopping the command stops
the actors (and their workers) and disconnects from Ray.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from dataclasses import dataclass

from sage_infer.errors import ConfigError, NotAvailableError
from sage_infer.router.launch import LOOPBACK, READY, PDGroup, worker_flags


def ray_missing() -> str | None:
    """Why Ray cannot be used here, or None."""
    try:
        import ray  # noqa: F401
    except ImportError as err:
        return f"Ray is not installed (pip install 'sage-infer[ray]'): {err}"
    return None


@dataclass
class RayWorker:
    role: str
    index: int
    actor: object
    url: str
    model: str

    @property
    def name(self) -> str:
        return f"{self.role}-{self.index}"


def _serve_on_node(args: list[str], host: str, port: int, env: dict[str, str]) -> tuple[subprocess.Popen, str, str]:
    """`sage llm serve ARGS` on this node, on loopback unless `host` is not (then on all interfaces, reached at the
    node's IP): (its process, URL, model) once it serves; RuntimeError with its last lines if it exits first."""
    bind = host
    if host not in LOOPBACK:
        import ray

        bind, host = "0.0.0.0", ray.util.get_node_ip_address()
    proc = subprocess.Popen([sys.executable, "-m", "sage_infer.cli.main", "llm", "serve", *args, "--host", bind,
                             "--port", str(port)], env={**os.environ, **env}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, bufsize=1)
    lines: list[str] = []
    for line in proc.stdout:
        lines = (lines + [line])[-40:]
        match = READY.search(line)
        if match:
            return proc, f"http://{host}:{match.group(2).rsplit(':', 1)[1]}", match.group(1)
    raise RuntimeError("the worker exited before it served:\n" + "".join(lines))


def _stop(proc: subprocess.Popen | None) -> None:
    if proc is not None and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()


def _connect(address: str | None):
    """Ray, joined to the cluster at `address` (a local instance unless given); NotAvailableError without Ray."""
    why = ray_missing()
    if why is not None:
        raise NotAvailableError(f"--launcher ray: {why}")
    import ray

    ray.init(address=address, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True,
             configure_logging=False)
    return ray


def _actor_class():
    import ray

    @ray.remote(num_cpus=0)  # the worker process it starts does the computing; the actor only owns it
    class ServeActor:
        def __init__(self) -> None:
            self.proc: subprocess.Popen | None = None

        def start(self, args: list[str], host: str, env: dict[str, str]) -> tuple[str, str]:
            self.proc, url, model = _serve_on_node(args, host, 0, env)
            threading.Thread(target=self._drain, daemon=True).start()
            return url, model

        def _drain(self) -> None:
            for _ in self.proc.stdout:
                pass

        def stop(self) -> None:
            _stop(self.proc)

    return ServeActor


class RayLauncher:
    """Starts and stops the workers of one deployment as Ray actors."""

    def __init__(self, address: str | None = None) -> None:
        self.ray = _connect(address)
        self.workers: list[RayWorker] = []

    def cpus(self) -> int:
        return int(self.ray.cluster_resources().get("CPU", 0))

    def start(self, num_prefill: int, num_decode: int, worker_args: list[str], disk_path: str | None,
              host: str, group: PDGroup | None = None, secrets: dict[str, str] | None = None) -> list[RayWorker]:
        """`secrets` (the API key, the transport token) reach the workers as environment variables,
        not on their command lines."""
        actor_class = _actor_class()
        pending = []
        for role, count in (("prefill", num_prefill), ("decode", num_decode)):
            for i in range(count):
                args = [*worker_args, *worker_flags(role, i, disk_path, group)]
                actor = actor_class.remote()
                pending.append((role, i, actor, actor.start.remote(args, host, secrets or {})))
        for role, i, actor, started in pending:
            try:
                url, model = self.ray.get(started)
            except Exception as err:  # noqa: BLE001 - a worker that did not start: say which and why
                self.stop()
                raise ConfigError(f"--launcher ray: the {role}-{i} worker did not start: {err}") from None
            self.workers.append(RayWorker(role, i, actor, url, model))
        return self.workers

    def stop(self) -> None:
        for worker in self.workers:
            try:
                self.ray.get(worker.actor.stop.remote(), timeout=30)
            except Exception:  # noqa: BLE001 - stopping what is left; the actor may be gone already
                pass
        self.workers = []
        self.ray.shutdown()


def _replica_actor_class(num_cpus: int):
    import ray

    @ray.remote(num_cpus=num_cpus, max_restarts=-1, max_task_retries=0)
    class ReplicaActor:
        """Owns one replica's `sage llm serve` on a fixed port. The constructor runs again when Ray restarts the
        actor, so a replica whose server died (the actor exits with it) comes back at the same address, where the
        fleet router finds it and takes its snapshot."""

        def __init__(self, args: list[str], host: str, port: int, env: dict[str, str]) -> None:
            self.stopping = False
            self.proc, url, model = _serve_on_node(args, host, port, {"OMP_NUM_THREADS": str(num_cpus), **env})
            self.address = (url, model)
            threading.Thread(target=self._watch, daemon=True).start()

        def _watch(self) -> None:
            for _ in self.proc.stdout:
                pass
            self.proc.wait()
            if not self.stopping:  # it died: so does the actor, and Ray starts both again
                os._exit(1)

        def address_of(self) -> tuple[str, str]:
            return self.address

        def stop(self) -> None:
            self.stopping = True
            _stop(self.proc)

    return ReplicaActor


class RayReplicas:
    """Starts and stops a fleet's replicas as restartable Ray actors, one per replica, each reserving
    `cpus_per_replica` of the cluster's CPUs (Ray places them; the cores within a node are the OS's to pick)."""

    def __init__(self, address: str | None = None) -> None:
        self.ray = _connect(address)
        self.actors: list = []

    def cpus(self) -> int:
        return int(self.ray.cluster_resources().get("CPU", 0))

    def start(self, n: int, cpus_per_replica: int, worker_args: list[str], disk_path: str | None, host: str,
              secrets: dict[str, str] | None = None) -> list[RayWorker]:
        from sage_infer.hal.net import free_port

        actor_class = _replica_actor_class(cpus_per_replica)
        self.actors = [actor_class.remote([*worker_args, *worker_flags("replica", i, disk_path, None)], host,
                                          free_port(), secrets or {}) for i in range(n)]
        workers = []
        for i, actor in enumerate(self.actors):
            try:
                url, model = self.ray.get(actor.address_of.remote())
            except Exception as err:  # noqa: BLE001 - a replica that did not start: say which and why
                self.stop()
                raise ConfigError(f"--launcher ray: replica-{i} did not start: {err}") from None
            workers.append(RayWorker("replica", i, actor, url, model))
        return workers

    def stop(self) -> None:
        for actor in self.actors:
            try:
                self.ray.get(actor.stop.remote(), timeout=30)
                self.ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - stopping what is left; the actor may be gone already
                pass
        self.actors = []
        self.ray.shutdown()

