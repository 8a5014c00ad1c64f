"""Time from `sage llm serve` to its first answered request, as a new user sees it after `make install`.

Starts ``sage llm serve`` (the bundled demo model unless --model) on a free loopback port with an empty kernel
cache (``SAGE_KERNEL_CACHE``), so a kernel compile at start-up cannot hide behind an earlier one, and sends one
completion until it is answered. Prints the seconds, the server's `cpu_kernels` start-up line, and whether it
compiled kernels; writes JSON. Exit 1 when nothing answered within --timeout, or, with --no-compile (what
`.ci/run` passes), when the server compiled kernels instead of loading the install's build.

    python bench/first_start.py --no-compile --out out/first_start.json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

COMPILE_LINE = "sage: compiling "


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def answered(port: int) -> bool:
    body = json.dumps({"model": "sage-demo", "prompt": "ROMEO:", "max_tokens": 4}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status == 200 and bool(json.load(response).get("choices"))
    except (urllib.error.URLError, ConnectionError, TimeoutError, json.JSONDecodeError):
        return False


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sage", default=str(Path(sys.executable).with_name("sage")), help="the sage executable")
    parser.add_argument("--model", default=None, help="model directory (default: the bundled demo)")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--no-compile", action="store_true", help="fail when the server compiles kernels")
    parser.add_argument("--out", default=None, help="write the result as JSON here")
    args = parser.parse_args()

    port = free_port()
    command = [args.sage, "llm", "serve", "--port", str(port)] + (["--model", args.model] if args.model else [])
    with tempfile.TemporaryDirectory() as cache, tempfile.TemporaryFile("w+") as log:
        env = {**os.environ, "SAGE_KERNEL_CACHE": cache}
        start = time.perf_counter()
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        seconds = None
        try:
            while time.perf_counter() - start < args.timeout and server.poll() is None:
                if answered(port):
                    seconds = time.perf_counter() - start
                    break
                time.sleep(0.25)
        finally:
            server.terminate()
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()
        log.seek(0)
        output = log.read()
    compiled = COMPILE_LINE in output
    kernels = next((line.split("cpu_kernels", 1)[1].strip(" =:") for line in output.splitlines()
                    if "cpu_kernels" in line), "not logged")
    result = {"command": " ".join(command[1:]), "first_answer_s": None if seconds is None else round(seconds, 2),
              "compiled_kernels_at_start": compiled, "cpu_kernels": kernels, "timeout_s": args.timeout}
    print(f"first answer after {'-' if seconds is None else f'{seconds:.1f} s'}; cpu kernels: {kernels}; "
          f"compiled kernels at start: {'yes' if compiled else 'no'}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    if seconds is None:
        print(f"no answer within {args.timeout:.0f} s; the server said:\n{output[-4000:]}", file=sys.stderr)
        return 1
    if args.no_compile and compiled:
        print("the server compiled kernels at start-up: the install did not build them (or built other sources):\n"
              + "\n".join(line for line in output.splitlines() if "kernel" in line), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
