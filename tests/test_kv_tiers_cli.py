"""`--kv-tiers` sets the `tiers:` section; a bad value is one line and exit code 2."""

from __future__ import annotations

import json

import pytest


def tiers_rows(sage, *flags: str) -> dict:
    result = sage("config", "show", "--preset", "cpu", "--json", *flags)
    assert result.code == 0, result.err
    return {r["field"]: r for r in json.loads(result.out)["fields"] if r["field"].startswith("tiers.")}


def test_kv_tiers_flag_sets_every_tier(sage, tmp_path):
    rows = tiers_rows(sage, "--kv-tiers", f"host=64MiB,disk={tmp_path}:1GiB",
                      "--kv-tiers", "remote=redis://127.0.0.1:6379/0,remote-bytes=2GiB")
    assert rows["tiers.host_bytes"]["value"] == 64 << 20
    assert (rows["tiers.disk_path"]["value"], rows["tiers.disk_bytes"]["value"]) == (str(tmp_path), 1 << 30)
    assert rows["tiers.remote_url"]["value"] == "redis://127.0.0.1:6379/0"
    assert rows["tiers.remote_bytes"]["value"] == 2 << 30
    assert rows["tiers.host_bytes"]["origin"] == "--kv-tiers host=64MiB"
    assert all(r["active"] for r in rows.values())


@pytest.mark.parametrize(("flag", "message"), [
    ("disk=/var/cache/sage", "expected disk=PATH:SIZE"),
    ("ssd=1GiB", "unknown tier 'ssd'"),
    ("host=-5", "tiers.host_bytes"),
    ("remote=http://example", "tiers.remote_url"),
    ("host", "expected key=value"),
])
def test_a_bad_kv_tiers_value_is_one_line_and_exit_2(sage, flag, message):
    result = sage("config", "show", "--kv-tiers", flag)
    assert result.code == 2
    lines = [line for line in result.err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("sage: error:") and message in lines[0]


@pytest.mark.parametrize("directory", ["/proc/self", "/proc/self/kv"])
def test_a_disk_tier_that_cannot_hold_files_fails_at_start_up(sage, directory):
    result = sage("llm", "generate", "--prompt", "x", "--max-tokens", "1", "--kv-tiers", f"disk={directory}:1GiB")
    assert result.code == 2 and "Traceback" not in result.err, result.err
    last = result.err.strip().splitlines()[-1]
    assert last.startswith("sage: error:") and f"directory {directory}: cannot hold files" in last, last
    assert "tiers.disk_path" in last
