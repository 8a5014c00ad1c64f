"""bench/gate.py's verdicts (the measuring itself runs in `make bench-gate`, never in the tests)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from bench.gate import compare

REPO = Path(__file__).resolve().parents[1]


def test_a_ratio_below_its_floor_beyond_the_tolerance_fails_and_unmeasured_ones_are_skipped(capsys):
    floors = {"hf.random.output_tok_s": 2.0, "vllm.qwen3-11m.W2.output_tok_s": 1.0, "hf.shared-prefix.x": 1.5}
    measured = {"hf.random.output_tok_s": 1.75, "vllm.qwen3-11m.W2.output_tok_s": 0.8}
    failures = compare(measured, floors, tolerance=0.15)
    assert failures == ["vllm.qwen3-11m.W2.output_tok_s: 0.80 < floor 1.00 (tolerance 15%)"]  # 1.75 >= 2.0 * 0.85
    assert "hf.shared-prefix.x" not in capsys.readouterr().out


def test_a_ratio_with_no_floor_is_printed_not_checked(capsys):
    failures = compare({"vllm.qwen3-11m.W4.output_tok_s": 0.5, "hf.random.output_tok_s": 2.0},
                       {"hf.random.output_tok_s": 2.0}, tolerance=0.15)
    assert failures == []
    out = capsys.readouterr().out
    assert "vllm.qwen3-11m.W4.output_tok_s" in out and "no floor yet (not checked)" in out


def test_an_unreadable_baseline_is_exit_2(tmp_path):
    result = subprocess.run([sys.executable, "bench/gate.py", "--baseline", str(tmp_path / "missing.json")],
                            cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 2 and "cannot read" in result.stderr
