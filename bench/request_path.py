"""How many source files one chat request crosses: what a contributor must read to follow it.

Builds the server over the native backend exactly as `sage llm serve` does (`server.launch.build_server`,
the bundled demo model unless --model), answers one warm-up chat request, then records every
`sage_infer` source file whose code runs while a second, identical request is served (the HTTP
handler, the engine thread's steps, the kernels' Python wrappers), through `sys.setprofile` and
`threading.setprofile`. Prints the files by package and writes JSON.

    .venv/bin/python bench/request_path.py --out out/request_path.json
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from collections import defaultdict
from pathlib import Path

import sage_infer

PACKAGE = Path(sage_infer.__file__).parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a local model directory (default: the bundled demo model)")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--out", default="out/request_path.json")
    args = parser.parse_args()

    from fastapi.testclient import TestClient

    from sage_infer.config.resolve import resolve_config
    from sage_infer.server.launch import build_server

    files: set[str] = set()
    recording = threading.Event()

    def profile(frame, event, arg):  # noqa: ARG001 - the profiler's signature
        if event == "call" and recording.is_set():
            files.add(frame.f_code.co_filename)

    cli = {"model": {"path": args.model}} if args.model else {}
    threading.setprofile(profile)  # before the engine thread starts
    server, backend, _ = build_server(resolve_config(preset="cpu", cli=cli, env={}).config)
    body = {"model": backend.model_info().name, "max_tokens": args.max_tokens, "temperature": 0,
            "messages": [{"role": "user", "content": "What light through yonder window breaks?"}]}
    with TestClient(server.config.app) as client:
        assert client.post("/v1/chat/completions", json=body).status_code == 200  # warm-up: imports, first step
        sys.setprofile(profile)
        recording.set()
        response = client.post("/v1/chat/completions", json=body)
        recording.clear()
        sys.setprofile(None)
        assert response.status_code == 200, response.text
    threading.setprofile(None)
    backend.shutdown()

    ours = sorted(str(Path(f).resolve().relative_to(PACKAGE.parent)) for f in files
                  if Path(f).resolve().is_relative_to(PACKAGE))
    by_package: dict[str, list[str]] = defaultdict(list)
    for name in ours:
        parts = Path(name).parts
        by_package[parts[1] if len(parts) > 2 else "(top)"].append(name)
    for package, names in sorted(by_package.items()):
        print(f"{package:>14}  {len(names):3d}  " + ", ".join(Path(n).name for n in names))
    print(f"{'total':>14}  {len(ours):3d} sage_infer files")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"files": ours, "count": len(ours),
                               "by_package": {k: len(v) for k, v in by_package.items()}}, indent=2) + "\n")


if __name__ == "__main__":
    main()
