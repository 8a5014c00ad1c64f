"""Workers started by this command come back when they die: `sage llm serve --replicas N` and `--pd xPyD` with
the local launcher (the Ray launcher has Ray restart its actors).

A `Supervisor` thread watches the worker processes; one that exits while the deployment is not stopping is
started again with the same flags, cores and port, so its URL — which the router follows — stays the same: the
router takes it out of the routing when its event stream breaks and back in when the new process sends its
snapshot. A worker that keeps dying (`MAX_RESTARTS` within `RESTART_WINDOW_S`) is left down, and said so.
"""

from __future__ import annotations

import logging
import threading
import time
from urllib.parse import urlsplit

from sage_infer.router.launch import Worker, spawn_worker

log = logging.getLogger("sage_infer.router")
POLL_S = 0.5
MAX_RESTARTS = 5
RESTART_WINDOW_S = 300.0


class Supervisor:
    """Restarts `workers` (in place in the list) that exit until `stop()`."""

    def __init__(self, workers: list[Worker]) -> None:
        self.workers = workers
        self.restarts: dict[int, list[float]] = {}  # worker position -> when it was restarted
        self.given_up: set[int] = set()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sage-supervisor", daemon=True)

    def start(self) -> Supervisor:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Before the workers are stopped: an exit from now on is expected."""
        self._stopping.set()
        self._thread.join(5)

    def _run(self) -> None:
        while not self._stopping.wait(POLL_S):
            for i, worker in enumerate(self.workers):
                if i not in self.given_up and worker.process.poll() is not None and not self._stopping.is_set():
                    self._restart(i, worker)

    def _restart(self, i: int, worker: Worker) -> None:
        now = time.monotonic()
        recent = [t for t in self.restarts.get(i, []) if now - t < RESTART_WINDOW_S]
        if len(recent) >= MAX_RESTARTS:
            self.given_up.add(i)
            log.error("%s exited (code %s) %d times in %.0f s: left down", worker.name, worker.process.returncode,
                      len(recent) + 1, RESTART_WINDOW_S)
            return
        port = urlsplit(worker.url).port if worker.url else 0
        log.warning("%s exited (code %s): starting it again on port %s", worker.name, worker.process.returncode,
                    port)
        self.restarts[i] = [*recent, now]
        self.workers[i] = spawn_worker(worker.role, worker.index, worker.args, worker.cpus, port or 0)
