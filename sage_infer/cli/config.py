"""`sage config ...`: show the resolved configuration and where each value came from."""

from __future__ import annotations

import typer

from sage_infer.cli.options import (
    ConfigFileOpt,
    JsonOpt,
    KVTiersOpt,
    KVTransportOpt,
    ModelOpt,
    PresetOpt,
    SetOpt,
    SpeculativeOpt,
    resolve_flags,
)
from sage_infer.cli.output import emit, table
from sage_infer.config.inactive import section_of

app = typer.Typer(help="Inspect the resolved configuration.", no_args_is_help=True)

_SOURCE_STYLE = {"default": "dim", "preset": "cyan", "config": "magenta", "env": "yellow", "cli": "green"}


@app.command("show")
def show(
    preset: PresetOpt = None,
    config: ConfigFileOpt = None,
    kv_transport: KVTransportOpt = None,
    kv_tiers: KVTiersOpt = None,
    set_: SetOpt = None,
    speculative_config: SpeculativeOpt = None,
    model: ModelOpt = None,
    hardware: bool = typer.Option(False, "--hardware", help="Also list every hardware preset field."),
    as_json: JsonOpt = False,
) -> None:
    """Print every resolved value with its source (cli > env > config > preset > default);
    fields the serve process does not use yet are marked INACTIVE with the reason."""
    resolved = resolve_flags(preset, config, kv_transport, set_, {"model.path": ("--model", model)}, kv_tiers,
                             speculative_config)
    rows = resolved.rows()
    data = {
        "hardware_preset": resolved.hardware_preset,
        "transport_preset": resolved.transport_preset,
        "fields": rows,
    }
    from sage_infer.models.kv_group_report import kv_group_rows  # (reads the model's config.json: torch)

    groups = kv_group_rows(resolved.config)
    if groups is not None:
        data["kv_dtype_counted"], data["kv_groups"], data["kv_sequence"] = groups

    def render(console) -> None:
        shown = [r for r in rows if hardware or not r["field"].startswith("hardware.")]
        console.print(
            table(
                f"Resolved config (hardware preset: {resolved.hardware_preset}, "
                f"transport preset: {resolved.transport_preset or 'none'})",
                ["field", "value", "source", "origin", "used"],
                [
                    (r["field"], r["value"], f"[{_SOURCE_STYLE[r['source']]}]{r['source']}[/]", r["origin"],
                     "yes" if r["active"] else "[red]INACTIVE[/]")
                    for r in shown
                ],
            )
        )
        for section, reason in sorted({section_of(r["field"]): r["inactive_reason"]
                                       for r in shown if not r["active"]}.items()):
            console.print(f"[red]INACTIVE[/] {section}: {reason}")
        if not hardware:
            console.print("[dim]hardware.* fields hidden; add --hardware to list them[/dim]")
        if groups is not None:
            console.print(table(f"KV groups of the model (kv_dtype {groups[0]}; a pool block holds one group's layers)",
                                ["group", "kind", "layers", "bytes/token", "tokens/GiB", "kept per sequence"],
                                [(r["group"], r["kind"], ",".join(map(str, r["layers"])), r["bytes_per_token"],
                                  r["tokens_per_gib"], r["max_tokens_per_sequence"] or "all")
                                 for r in groups[1]]))
            seq = groups[2]
            console.print(f"A sequence of {seq['tokens']} tokens keeps {seq['bytes'] / 2**20:.1f} MiB of KV, "
                          f"{seq['bytes'] / seq['full_attention_bytes']:.2f} x what every layer keeping every token "
                          f"would ({seq['full_attention_bytes'] / 2**20:.1f} MiB)")

    emit(data, as_json, render)
