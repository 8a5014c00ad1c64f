"""A real `mooncake_master` on free loopback ports, for the Mooncake Store KV tier tests.

Skips (with the reason) when the `mooncake-transfer-engine` package, its `mooncake_master`
binary or the system library it links (libibverbs1) is missing. The members find each other
with P2PHANDSHAKE, so no metadata server is needed.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

from tests.redis_fixture import ServerProcess, free_port

MOONCAKE_MISSING = "Mooncake Store not installed (pip install 'sage-infer[mooncake]')"


class MooncakeMaster(ServerProcess):
    pass


def master_binary() -> str | None:
    """The `mooncake_master` the package ships (next to `mooncake/store.so`), else one on PATH."""
    spec = importlib.util.find_spec("mooncake")
    if spec is not None and spec.submodule_search_locations:
        for folder in spec.submodule_search_locations:
            candidate = Path(folder) / "mooncake_master"
            if candidate.is_file():
                if not os.access(candidate, os.X_OK):
                    candidate.chmod(candidate.stat().st_mode | 0o111)
                return str(candidate)
    return shutil.which("mooncake_master")


def require_mooncake() -> None:
    """Skip the test, naming what is missing, unless `mooncake.store` imports."""
    from sage_infer.errors import NotAvailableError
    from sage_infer.kv_runtime.tiers.mooncake import load_store_class

    if importlib.util.find_spec("mooncake") is None:
        pytest.skip(MOONCAKE_MISSING)
    try:
        load_store_class()
    except NotAvailableError as err:
        pytest.skip(str(err))


def start_master(*flags: str, port: int | None = None) -> MooncakeMaster:
    """Start one master (on `port`, else a free one) and wait until its RPC port accepts connections."""
    require_mooncake()
    binary = master_binary()
    if binary is None:
        pytest.skip("the mooncake_master binary is missing from the mooncake package and PATH")
    port = port or free_port()
    args = [
        binary, f"-rpc_port={port}", "-rpc_address=127.0.0.1", f"-metrics_port={free_port()}",
        "-metrics_host=127.0.0.1", "-enable_metric_reporting=false", "-logtostderr=true", "-minloglevel=2", *flags,
    ]
    process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    master = MooncakeMaster(f"mooncake://127.0.0.1:{port}", port, process)
    deadline = time.monotonic() + 20
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return master
        except OSError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            master.kill()
            raise RuntimeError(f"mooncake_master on port {port} did not start (exit code {process.poll()})")
        time.sleep(0.05)
