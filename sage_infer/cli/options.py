"""Option aliases shared by every command group (same flag, same help, everywhere)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]
PresetOpt = Annotated[
    Optional[str],
    typer.Option("--preset", "-p", help="Hardware preset name or YAML path (default: detect this machine)."),
]
ConfigFileOpt = Annotated[
    Optional[Path], typer.Option("--config", "-c", help="YAML file with ServeConfig fields.", dir_okay=False)
]
KVTransportOpt = Annotated[
    Optional[list[str]],
    typer.Option(
        "--kv-transport",
        help="KV transport key=value, repeatable: preset=high-bw, backend=shm, target-dtype=fp8_e4m3, "
        "chunk-size=4MiB, max-inflight=16, timeout-s=10 ...",
    ),
]
KVTiersOpt = Annotated[
    Optional[list[str]],
    typer.Option(
        "--kv-tiers",
        help="Lower KV tiers, repeatable or comma-separated: host=8GiB, disk=/path:50GiB, "
        "remote=redis://127.0.0.1:6379/0, remote-bytes=2GiB.",
    ),
]
SetOpt = Annotated[
    Optional[list[str]],
    typer.Option("--set", help="Any config field as section.field=value, e.g. kv_pool.block_size=32 (repeatable)."),
]
SpeculativeOpt = Annotated[
    Optional[str],
    typer.Option("--speculative-config", help="Speculative decoding as JSON (the speculative.* fields), e.g. "
                 """'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, """
                 """"prompt_lookup_max": 5}'."""),
]
ToolCallParserOpt = Annotated[
    Optional[str],
    typer.Option("--tool-call-parser", help="How tool calls are read from the model's text (model.tool_call_parser): "
                 "hermes, llama3_json, mistral, pythonic, deepseek_v3, auto (the chat template's own format; "
                 "default), none."),
]
ReasoningParserOpt = Annotated[
    Optional[str],
    typer.Option("--reasoning-parser", help="Split <think>...</think> off as reasoning_content "
                 "(model.reasoning_parser): qwen3, deepseek_r1, none (default)."),
]
DeterministicOpt = Annotated[
    Optional[bool],
    typer.Option("--deterministic", help="Batch-invariant output (model.deterministic): a request's tokens and "
                 "logprobs do not depend on what else is batched with it; slower. CPU."),
]
KVCacheDtypeOpt = Annotated[
    Optional[str],
    typer.Option("--kv-cache-dtype", help="KV cache element type (kv_pool.kv_dtype): auto, bf16, fp16, fp32, "
                 "or quantized fp8_e4m3, fp8_e5m2, int8, int4 (one fp16 scale per token and head)."),
]
BackendOpt = Annotated[
    Optional[str],
    typer.Option("--backend", help="Inference backend: native (default), vllm, lmdeploy (sage infer backends:list)."),
]
ModelOpt = Annotated[
    Optional[str], typer.Option("--model", "-m", help="Local Hugging Face model directory (default: bundled demo).")
]


def resolve_flags(
    preset: str | None,
    config_file: Path | None,
    kv_transport: list[str] | None,
    sets: list[str] | None,
    named: dict[str, tuple[str, object]] | None = None,
    kv_tiers: list[str] | None = None,
    speculative: str | None = None,
):
    """Resolve the process config from the shared flags.

    `named` maps dotted field -> (flag text, value) for a command's own flags
    (``{"model.path": ("--model", path)}``); None values are skipped.
    """
    from sage_infer.config.overrides import (
        CliLayer,
        add_kv_tiers_flags,
        add_kv_transport_flags,
        add_set_flags,
        add_speculative_flag,
    )
    from sage_infer.config.resolve import resolve_config

    layer = CliLayer()
    add_set_flags(layer, sets)
    add_kv_transport_flags(layer, kv_transport)
    add_kv_tiers_flags(layer, kv_tiers)
    add_speculative_flag(layer, speculative)
    for dotted, (flag, value) in (named or {}).items():
        if value is not None:
            layer.set(dotted, value, flag)
    return resolve_config(
        preset=preset, config_file=config_file, cli=layer.values, cli_origins=layer.origins
    )
