from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

# Without a CUDA GPU the Triton decode kernel's tests run its code under Triton's interpreter, which must be
# chosen before triton is first imported (tests/test_triton_paged.py).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# rich fixes a console's width at its creation when COLUMNS is set (pytest-xdist's workers get the controller's
# width that way): without it the width is read at each print, so the `sage` fixture's COLUMNS=200 holds
os.environ.pop("COLUMNS", None)

from sage_infer.cli.main import main  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DATA = Path(__file__).resolve().parent / "data"


@dataclass
class CliResult:
    code: int
    out: str
    err: str


@pytest.fixture
def sage(capsys, monkeypatch):
    """Run the `sage` CLI in-process: ``sage("config", "show", "--json")``."""
    monkeypatch.delenv("SAGE_DEBUG", raising=False)
    monkeypatch.setenv("COLUMNS", "200")

    def run(*argv: str) -> CliResult:
        capsys.readouterr()
        code = main(list(argv))
        captured = capsys.readouterr()
        return CliResult(code, captured.out, captured.err)

    return run


@pytest.fixture(autouse=True)
def _no_sage_env(monkeypatch):
    """Tests set the SAGE_* variables they need; none leak in from the shell."""
    import os

    for key in list(os.environ):
        if key.startswith("SAGE_"):
            monkeypatch.delenv(key)


def runnable_cpu_levels() -> list[str]:
    """The ISA levels of the CPU kernels this CPU can run (`sage_infer.hal.isa`), lowest first: a kernel's oracle
    tests run at each, so the AVX2 build is tested on every x86 machine."""
    from sage_infer.hal.isa import build_levels, selected_level

    levels = build_levels()
    top, _ = selected_level({})
    return [] if top is None else list(levels[: levels.index(top) + 1])


@pytest.fixture
def one_thread():
    """Tiny models on one torch thread (more only contend on a shared machine); a module opts in with
    ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(params=runnable_cpu_levels() or ["none"])
def cpu_isa(request, monkeypatch) -> str:
    """Each test that uses it runs once per ISA level this CPU has, with ``SAGE_CPU_ISA`` forcing that level."""
    if request.param != "none":
        monkeypatch.setenv("SAGE_CPU_ISA", request.param)
    return request.param


# The server every server test module shares by default (one per module: module scope).
# A module that needs another model or server defines its own `model_dir` / `server`.


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tests.tiny_models import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("server") / "tiny-llama", "llama")


@pytest.fixture(scope="module")
def server(model_dir):
    from tests.server_fixture import running_server

    with running_server(model_dir) as running:
        yield running


@pytest.fixture
def client(server):
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
