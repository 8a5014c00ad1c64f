"""Every mistake a user can make with a flag, a preset or an env var is one line on
stderr naming where it is, exit code 2, never a traceback."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

MALFORMED_PRESETS = {
    # name: (file text, what the one line must contain)
    "yaml_syntax": ("extends: ascend-910b\nname: my\nmemory:\n  hbm_gb: [5\n", ["YAML syntax error"]),
    "unknown_field": ("extends: ascend-910b\nname: my\nmemroy:\n  hbm_gb: 5\n", [":3:", "unknown field 'memroy'"]),
    "wrong_type": ("extends: ascend-910b\nname: my\nmemory:\n  hbm_gb: lots\n",
                   [":4:", "memory.hbm_gb", "valid number", "'lots'"]),
    "out_of_range": ("extends: ascend-910b\nname: my\nmemory:\n  hbm_gb: -5\n",
                     [":4:", "memory.hbm_gb", "greater than 0", "-5"]),
    "nested_unknown": ("extends: cpu\nname: my\nkv:\n  dtypes: [bf16]\n  default_dtype: bf16\n  defualt: 1\n",
                       [":6:", "kv.defualt", "unknown field", "default_dtype"]),
    "bad_enum": ("extends: cpu\nname: my\ntransport:\n  backends: [shm, carrier-pigeon]\n",
                 [":4:", "transport.backends.1", "'carrier-pigeon'"]),
    "default_dtype_unsupported": ("extends: cpu\nname: my\nkv:\n  default_dtype: fp8_e4m3fnuz\n",
                                  ["kv", "fp8_e4m3fnuz", "not in kv.dtypes"]),
    "duplicate_key": ("extends: cpu\nname: a\nname: b\n", [":3:", "duplicate key 'name'"]),
    "missing_fields": ("name: lonely\nvendor: nvidia\n", ["missing required field"]),
    "unknown_base": ("extends: nvidia-b999\nname: my\n", ["unknown hardware preset 'nvidia-b999'"]),
    "not_a_mapping": ("- just\n- a list\n", [":1:", "expected a mapping"]),
    "bad_source_confidence": (
        "extends: cpu\nname: my\nsources:\n  memory.hbm_gb:\n    confidence: pretty-sure\n",
        [":5:", "sources.memory.hbm_gb.confidence", "'pretty-sure'"],
    ),
    "source_for_unknown_field": ("extends: cpu\nname: my\nsources:\n  memory.hbm_tb:\n    confidence: official\n",
                                 ["memory.hbm_tb", "not a field"]),
}


def _one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected one line, got: {err!r}"
    assert "Traceback" not in err
    return lines[0]


@pytest.mark.parametrize("case", list(MALFORMED_PRESETS))
def test_malformed_preset_is_one_line_exit_2(sage, tmp_path, case):
    text, must_contain = MALFORMED_PRESETS[case]
    path = tmp_path / f"{case}.yaml"
    path.write_text(text)
    result = sage("infer", "presets:validate", str(path))
    assert result.code == 2
    line = _one_line(result.err)
    assert str(path) in line
    for fragment in must_contain:
        assert fragment in line


@pytest.mark.parametrize("case", ["wrong_type", "unknown_field", "yaml_syntax"])
def test_malformed_preset_fails_config_show_the_same_way(sage, tmp_path, case):
    text, must_contain = MALFORMED_PRESETS[case]
    path = tmp_path / "mine.yaml"
    path.write_text(text)
    result = sage("config", "show", "--preset", str(path))
    assert result.code == 2
    line = _one_line(result.err)
    assert all(fragment in line for fragment in must_contain)


def test_extends_cycle_is_rejected(sage, tmp_path):
    (tmp_path / "a.yaml").write_text("extends: b.yaml\nname: a\n")
    (tmp_path / "b.yaml").write_text("extends: a.yaml\nname: b\n")
    result = sage("infer", "presets:validate", str(tmp_path / "a.yaml"))
    assert result.code == 2
    assert "cycle" in _one_line(result.err)


BAD_FLAGS = {
    "unknown_transport_key": (
        ["--kv-transport", "speed=fast"], ["--kv-transport", "unknown key 'speed'", "chunk-size"]
    ),
    "bad_chunk_size": (["--kv-transport", "chunk-size=abc"], ["chunk-size=abc", "kv_transport.chunk_size"]),
    "chunk_size_too_small": (["--kv-transport", "chunk-size=1KiB"], ["between 4KiB and 1GiB"]),
    "bad_backend": (["--kv-transport", "backend=ftp"], ["backend=ftp", "'ftp'", "'shm'"]),
    "bad_target_dtype": (["--kv-transport", "target-dtype=fp4"], ["target-dtype=fp4", "'fp8_e4m3'"]),
    "bad_number": (["--kv-transport", "max-inflight=lots"], ["max_inflight", "'lots'"]),
    "missing_equals": (["--kv-transport", "backend"], ["expected key=value"]),
    "empty_value": (["--kv-transport", "backend="], ["empty value"]),
    "unknown_transport_preset": (["--kv-transport", "preset=warp-speed"], ["unknown transport preset 'warp-speed'"]),
    "unknown_hardware_preset": (["--preset", "nvidia-b999"], ["--preset", "unknown hardware preset"]),
    "set_unknown_section": (["--set", "gpu.count=3"], ["--set", "unknown section 'gpu'"]),
    "set_unknown_field": (["--set", "kv_pool.blok=3"], ["kv_pool.blok", "unknown field", "block_size"]),
    "set_bad_block_size": (["--set", "kv_pool.block_size=33"], ["power of two"]),
    "unknown_option": (["--bogus"], ["No such option: --bogus"]),
    "missing_config_file": (["--config", "/nonexistent/serve.yaml"], ["/nonexistent/serve.yaml", "not found"]),
}


@pytest.mark.parametrize("case", list(BAD_FLAGS))
def test_bad_flag_is_one_line_exit_2(sage, case):
    argv, must_contain = BAD_FLAGS[case]
    result = sage("config", "show", *argv)
    assert result.code == 2
    line = _one_line(result.err)
    for fragment in must_contain:
        assert fragment in line, line
    assert result.out == ""


def test_bad_env_var_names_the_variable(sage, monkeypatch):
    monkeypatch.setenv("SAGE_KV_POOL__BLOCK_SIZE", "33")
    result = sage("config", "show")
    assert result.code == 2
    assert "env SAGE_KV_POOL__BLOCK_SIZE" in _one_line(result.err)


def test_unknown_env_field_is_rejected(sage, monkeypatch):
    monkeypatch.setenv("SAGE_SCHEDULER__MAX_SEQS", "3")
    result = sage("config", "show")
    assert result.code == 2
    assert "unknown field 'max_seqs'" in _one_line(result.err)


def test_bad_config_file_value_names_file_and_line(sage, tmp_path):
    path = tmp_path / "serve.yaml"
    path.write_text(textwrap.dedent("""\
        kv_pool:
          block_size: 16
        tiers:
          remote_url: http://cache:6379
    """))
    result = sage("config", "show", "--config", str(path))
    assert result.code == 2
    line = _one_line(result.err)
    assert f"{path}:4" in line and "redis://" in line


def test_sage_debug_shows_the_traceback(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("extends: cpu\nname: x\nmemory:\n  hbm_gb: -1\n")
    code = "import sys; from sage_infer.cli.main import main; sys.exit(main(sys.argv[1:]))"
    done = subprocess.run([sys.executable, "-c", code, "infer", "presets:validate", str(path)],
                          capture_output=True, text=True, env={"SAGE_DEBUG": "1", "PATH": ""})
    assert done.returncode != 0
    assert "Traceback" in done.stderr and "ConfigError" in done.stderr


def test_serve_validates_config_before_loading_anything(sage, tmp_path):
    bad = sage("llm", "serve", "--port", "99999")
    assert bad.code == 2 and "port" in _one_line(bad.err)
    missing = sage("llm", "serve", "--model", str(tmp_path / "no-such-model"), "--kv-transport", "preset=high-bw")
    assert missing.code == 2
    assert "no-such-model" in _one_line(missing.err) and "not found" in missing.err


@pytest.mark.parametrize("flags, message", [
    (["--set", "kv_pool.num_blocks=99999999999999"], "kv_pool.num_blocks: "),
    (["--kv-tiers", "host=1EiB"], "tiers.host_bytes: "),
])
def test_a_size_beyond_the_machine_is_one_line_before_anything_is_allocated(sage, flags, message):
    result = sage("llm", "generate", "--prompt", "x", "--max-tokens", "1", *flags)
    assert result.code == 2 and "Traceback" not in result.err, result.err
    last = result.err.strip().splitlines()[-1]
    assert message in last and "GiB of host memory this machine has" in last, last


def _alias_bomb(levels: int = 9, fan_out: int = 9) -> str:
    """`levels` anchors, each a list of `fan_out` aliases of the one before: fan_out**levels values."""
    anchors = [f"l{i}" for i in range(levels)]
    lines = [f"    {anchors[0]}: &{anchors[0]} [{', '.join(['x'] * fan_out)}]"]
    for prev, name in zip(anchors, anchors[1:]):
        lines.append(f"    {name}: &{name} [{', '.join([f'*{prev}'] * fan_out)}]")
    return "extends: cpu\nname: bomb\nmemory:\n  bomb:\n" + "\n".join(lines) + "\n"


@pytest.fixture
def within_seconds():
    """Fail (instead of hanging the suite) if the test body runs longer than the given seconds."""
    import signal

    def expired(signum, frame):
        raise TimeoutError("the alias bound did not trigger early")

    previous = signal.signal(signal.SIGALRM, expired)
    yield lambda seconds: signal.setitimer(signal.ITIMER_REAL, seconds)
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, previous)


@pytest.mark.parametrize("argv", [
    ["config", "show", "--config"],
    ["config", "show", "--preset"],
    ["infer", "presets:validate"],
])
def test_a_yaml_alias_bomb_is_refused_before_it_expands(sage, tmp_path, within_seconds, argv):
    path = tmp_path / "bomb.yaml"
    path.write_text(_alias_bomb())
    within_seconds(20)
    result = sage(*argv, str(path))
    assert result.code == 2
    line = _one_line(result.err)
    assert f"{path}:" in line and "aliases expand" in line, line


def test_a_yaml_alias_that_contains_itself_is_refused(sage, tmp_path):
    path = tmp_path / "loop.yaml"
    path.write_text("extends: cpu\nname: loop\nmemory: &m\n  again: *m\n")
    result = sage("infer", "presets:validate", str(path))
    assert result.code == 2
    assert f"{path}:3" in _one_line(result.err) and "contains it" in result.err


def test_a_few_small_aliases_still_load(sage, tmp_path):
    path = tmp_path / "aliases.yaml"
    path.write_text("kv_pool:\n  block_size: &n 16\nscheduler:\n  max_num_seqs: *n\n")
    result = sage("config", "show", "--config", str(path), "--json")
    assert result.code == 0, result.err
    fields = {f["field"]: f for f in json.loads(result.out)["fields"]}
    assert fields["scheduler.max_num_seqs"]["value"] == 16
    assert fields["scheduler.max_num_seqs"]["source"] == "config"
