"""`sage compress quantize MODEL OUT`: writes a quantized HF directory that `sage llm generate`
runs; every bad flag or input is one line and exit code 2."""

from __future__ import annotations

import json

import pytest

from sage_infer.models.loader import DEMO_MODEL_DIR


def _one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, f"expected one line, got: {err!r}"
    return lines[0]


def test_quantize_writes_a_model_that_generates(sage, tmp_path):
    out = tmp_path / "demo-w4"
    done = sage("compress", "quantize", str(DEMO_MODEL_DIR), str(out), "--scheme", "w4a16", "--group-size", "32",
                "--json")
    assert done.code == 0, done.err
    report = json.loads(done.out)
    assert report["scheme"] == "w4a16-g32" and report["method"] == "rtn"
    assert report["quantized_layers"] == 4 * 7  # 4 layers x q, k, v, o, gate, up, down
    assert report["bytes_after"] < report["bytes_before"] * 0.5
    weights = json.loads((out / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"]
    assert weights["weights"]["num_bits"] == 4 and weights["weights"]["group_size"] == 32
    gen = sage("llm", "generate", "--model", str(out), "--prompt", "ROMEO:", "--max-tokens", "8",
               "--temperature", "0", "--json")
    assert gen.code == 0, gen.err
    assert len(json.loads(gen.out.splitlines()[-1])["token_ids"]) == 8


def test_w8a16_defaults_to_one_scale_per_output_channel(sage, tmp_path):
    done = sage("compress", "quantize", str(DEMO_MODEL_DIR), str(tmp_path / "w8"), "--scheme", "w8a16", "--json")
    assert done.code == 0, done.err
    weights = json.loads((tmp_path / "w8" / "config.json").read_text())["quantization_config"]
    assert weights["config_groups"]["group_0"]["weights"]["strategy"] == "channel"


BAD = {
    # argv after MODEL OUT: what the one line names
    "scheme": (["--scheme", "w3a16"], "--scheme w3a16"),
    "group_size": (["--group-size", "100"], "--group-size 100"),
    "method": (["--method", "awq"], "--method awq"),
    "group_not_dividing": (["--group-size", "128"], "model.layers.0.mlp.down_proj.weight has 704 input columns"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_flag_is_one_line_and_exit_2(sage, tmp_path, case):
    argv, must = BAD[case]
    done = sage("compress", "quantize", str(DEMO_MODEL_DIR), str(tmp_path / "out"), *argv)
    assert done.code == 2 and must in _one_line(done.err)
    assert not (tmp_path / "out").exists()


def test_bad_directories_are_one_line_and_exit_2(sage, tmp_path):
    missing = sage("compress", "quantize", str(tmp_path / "nope"), str(tmp_path / "out"))
    assert missing.code == 2 and "no config.json" in _one_line(missing.err)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    busy = sage("compress", "quantize", str(DEMO_MODEL_DIR), str(tmp_path / "full"), "--group-size", "32")
    assert busy.code == 2 and "exists and is not empty" in _one_line(busy.err)


def test_an_unsupported_quantized_checkpoint_is_one_line_and_exit_2(sage, tmp_path):
    out = tmp_path / "q"
    assert sage("compress", "quantize", str(DEMO_MODEL_DIR), str(out), "--scheme", "w8a16").code == 0
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["weights"]["num_bits"] = 2
    (out / "config.json").write_text(json.dumps(config))
    gen = sage("llm", "generate", "--model", str(out), "--prompt", "x", "--max-tokens", "2")
    assert gen.code == 2
    line = _one_line(gen.err)
    assert "config.json: quantization_config.config_groups.group_0.weights.num_bits: 2 is not supported" in line
    again = sage("compress", "quantize", str(out), str(tmp_path / "twice"))
    assert again.code == 2 and "already quantized" in _one_line(again.err)
