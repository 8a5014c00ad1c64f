"""`sage transport ...`: probe this machine's devices and links."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from sage_infer.cli.options import JsonOpt
from sage_infer.cli.output import emit, table, yes_no
from sage_infer.errors import UsageError

app = typer.Typer(help="KV transport: probe hardware, recommend settings.", no_args_is_help=True)


@app.command("probe")
def probe(
    as_json: JsonOpt = False,
    write: Annotated[Optional[Path], typer.Option("--write", help="Save a hardware preset YAML here.")] = None,
    measure: Annotated[bool, typer.Option("--measure/--no-measure", help="Measure host copy bandwidth.")] = True,
) -> None:
    """Detect devices and links, match a preset, and recommend a KVTransportConfig."""
    from sage_infer.hal.detect import detect_devices
    from sage_infer.hal.recommend import (
        annotate_link_bandwidths,
        match_preset,
        measured_preset_yaml,
        recommend_transport,
    )

    report = detect_devices(measure=measure)
    preset = match_preset(report)
    annotate_link_bandwidths(report, preset)
    recommendation = recommend_transport(report, preset)
    written = None
    if write is not None:
        if write.suffix not in (".yaml", ".yml"):
            raise UsageError(f"--write {write}: expected a .yaml or .yml file name")
        try:
            write.write_text(measured_preset_yaml(report, preset, write.stem))
        except OSError as err:
            raise UsageError(f"--write {write}: cannot write: {err.strerror}") from None
        written = str(write)
    data = {
        **report.to_dict(),
        "matched_preset": preset,
        "recommended_kv_transport": recommendation.config.model_dump(mode="json"),
        "recommendation_reasons": recommendation.reasons,
        "written_preset": written,
    }

    def render(console) -> None:
        cpu = report.cpu
        numa = ", ".join(f"node{n.node}: {len(n.cpus)} cpus" for n in cpu.numa_nodes) or "unknown"
        bandwidth = f"{cpu.memcpy_gb_s:.1f} GB/s" if cpu.memcpy_gb_s else "not measured"
        console.print(f"[bold]host[/bold]: {cpu.model_name}; {cpu.logical_cores} logical cores; NUMA {numa}; "
                      f"memcpy {bandwidth}")
        devices = [(d.vendor, d.torch_device, d.name, f"{d.memory_bytes / 2**30:.1f}" if d.memory_bytes else "?")
                   for d in report.accelerators]
        console.print(table("Accelerators", ["vendor", "device", "name", "memory GiB"],
                            devices or [("-", "cpu", "none", "")]))
        console.print(table("Vendor probes", ["vendor", "found", "reason"],
                            [(v.vendor, yes_no(v.available), v.reason or "") for v in report.vendors]))
        links = [(v.vendor, link.a, link.b, link.link_class.value, link.label, link.bandwidth_gb_s)
                 for v in report.vendors if v.topology for link in v.topology.links]
        if links:
            console.print(table("Links", ["vendor", "a", "b", "class", "label", "GB/s per dir (preset)"], links))
        console.print(f"[bold]matched preset[/bold]: {preset}")
        console.print(table("Recommended KVTransportConfig", ["field", "value"],
                            list(recommendation.config.model_dump(mode="json").items())))
        for reason in recommendation.reasons:
            console.print(f"  - {reason}")
        console.print(f"flags: {recommendation.flags()}")
        if written:
            console.print(f"wrote {written}; load it with --preset {written}")

    emit(data, as_json, render)
