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
    transport_bench: Annotated[
        Optional[Path],
        typer.Option("--transport-bench", help="Use the bandwidths measured by `sage transport bench --json FILE`.",
                     exists=True, dir_okay=False),
    ] = None,
    measure_transport: Annotated[
        bool, typer.Option("--measure-transport", help="Run a short shm + tcp transport bench (32 MiB) and use it.")
    ] = False,
) -> None:
    """Detect devices and links, match a preset, and recommend a KVTransportConfig."""
    from sage_infer.config.recommend import (
        annotate_link_bandwidths,
        apply_transport_measurements,
        match_preset,
        measured_preset_yaml,
        recommend_transport,
    )
    from sage_infer.hal.detect import detect_devices

    report = detect_devices(measure=measure)
    preset = match_preset(report)
    annotate_link_bandwidths(report, preset)
    recommendation = recommend_transport(report, preset)
    if transport_bench is not None:
        recommendation = apply_transport_measurements(recommendation, _bench_results(transport_bench))
    if measure_transport:
        from dataclasses import asdict

        from sage_infer.transport.bench import run_bench

        measured = run_bench(["shm", "tcp"], 32 << 20, [1 << 20, 4 << 20], ["fp16"], repeats=2, zero_copy="off")
        recommendation = apply_transport_measurements(recommendation, [asdict(r) for r in measured])
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


def _bench_results(path: Path) -> list[dict]:
    import json

    try:
        results = json.loads(path.read_text())["results"]
        for r in results:
            r["backend"], int(r["chunk_bytes"]), float(r["gbps"]), float(r["ratio_to_baseline"]), r["dtype"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise UsageError(f"--transport-bench {path}: not a `sage transport bench --json` file ({err})") from None
    return results


def _sizes(flag: str, text: str) -> list[int]:
    from pydantic import ByteSize, TypeAdapter, ValidationError

    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        try:
            value = int(TypeAdapter(ByteSize).validate_python(part))
        except ValidationError:
            raise UsageError(f"{flag} {part}: expected a size like 1MiB or 268435456") from None
        if value <= 0:
            raise UsageError(f"{flag} {part}: must be > 0")
        out.append(value)
    if not out:
        raise UsageError(f"{flag}: expected at least one size")
    return out


def _names(flag: str, text: str, valid: tuple[str, ...], all_means: tuple[str, ...]) -> list[str]:
    names = [p.strip() for p in text.split(",") if p.strip()]
    if names == ["all"]:
        return list(all_means)
    bad = [n for n in names if n not in valid]
    if bad or not names:
        raise UsageError(f"{flag} {(','.join(bad) or text)!r}: expected a comma list of {', '.join(valid)} or all")
    return names


@app.command("bench")
def bench(
    backend: Annotated[str, typer.Option("--backend", help="shm,tcp,torchdist or all.")] = "shm,tcp",
    size: Annotated[str, typer.Option("--size", help="KV bytes per transfer.")] = "256MiB",
    chunk: Annotated[str, typer.Option("--chunk", help="Chunk sizes, comma list.")] = "1MiB,4MiB",
    dtype: Annotated[str, typer.Option("--dtype", help="Wire dtypes, comma list (fp16: as stored).")] = "fp16",
    repeats: Annotated[int, typer.Option("--repeats", min=1, max=50, help="Measured transfers after a warm-up.")] = 4,
    threads: Annotated[int, typer.Option("--threads", min=1, max=256, help="torch threads per process.")] = 1,
    zero_copy: Annotated[
        str, typer.Option("--zero-copy", help="shm only: off, on (receiver's shared arena), or both.")
    ] = "both",
    json_out: Annotated[Optional[Path], typer.Option("--json", help="Write results as JSON here.")] = None,
    checksum: Annotated[str, typer.Option("--checksum", help="crc32c (default) or none: the per-chunk checksum.")
                        ] = "crc32c",
) -> None:
    """Move KV between real sender and receiver processes on this host, per backend, next to
    the raw baseline measured in the same run (memcpy into shared memory, plain socket, plain
    dist.send/recv)."""
    from rich.console import Console

    from sage_infer.transport.base import backend_availability
    from sage_infer.transport.bench import BACKENDS, results_json, run_bench
    from sage_infer.transport.format.converter import WIRE_FORMATS

    backends = _names("--backend", backend, BACKENDS, BACKENDS)
    dtypes = _names("--dtype", dtype, WIRE_FORMATS, ("fp16", "fp8_e4m3", "int8", "int4"))
    chunks = _sizes("--chunk", chunk)
    (total,) = _sizes("--size", size)[:1]
    if any(c > total for c in chunks):
        raise UsageError(f"--chunk {chunk}: a chunk is larger than --size {size}")
    if zero_copy not in ("off", "on", "both"):
        raise UsageError(f"--zero-copy {zero_copy}: expected off, on or both")
    available = {a.name: a for a in backend_availability()}
    for name in backends:
        if not available[name].available:
            raise UsageError(f"--backend {name}: not available here: {available[name].reason}")
    console = Console(stderr=True)
    if checksum not in ("crc32c", "none"):
        raise UsageError(f"--checksum {checksum}: expected crc32c or none")
    results = run_bench(backends, total, chunks, dtypes, repeats=repeats, threads=threads, zero_copy=zero_copy,
                        checksum=checksum,
                        progress=lambda what: console.print(f"[dim]running {what}[/dim]"))
    rows = [
        (r.backend + (" zero-copy" if r.zero_copy else ""), f"{r.chunk_bytes >> 10} KiB", r.dtype, f"{r.gbps:.2f}",
         f"{r.baseline_gbps:.2f}", f"{r.crc_baseline_gbps:.2f}" if r.crc_baseline_gbps else "-",
         f"{r.ratio_to_baseline:.2f}", f"{r.ratio_to_as_stored:.2f}" if r.ratio_to_as_stored else "-",
         f"{r.p50_chunk_us:.0f}", f"{r.p99_chunk_us:.0f}",
         f"{100 * r.convert_share:.1f}%", f"{r.rel_rmse:.1e}" if r.rel_rmse else "0",
         f"{100 * r.receiver_cpu_share:.0f}%", f"{r.sender_cpu_us_per_chunk:.0f} / {r.receiver_cpu_us_per_chunk:.0f}")
        for r in results
    ]  # fmt: skip
    out = Console()
    out.print(table(f"KV transport, {total >> 20} MiB per transfer (GB/s of KV as stored, end to end)",
                    ["backend", "chunk", "wire dtype", "GB/s", "baseline GB/s", "+ CRC32C GB/s", "ratio",
                     "÷ as stored", "p50 chunk µs", "p99 chunk µs", "convert", "rel. RMSE", "receiver CPU",
                     "CPU µs/chunk send / recv"], rows))
    _print_peers(out, backends, results)
    if json_out is not None:
        import json

        data = results_json(results)
        data["size_bytes"] = total
        try:
            json_out.write_text(json.dumps(data, indent=2) + "\n")
        except OSError as err:
            raise UsageError(f"--json {json_out}: cannot write: {err.strerror}") from None
        out.print(f"wrote {json_out}")


def _print_peers(out, backends, results) -> None:
    """The lines under the bench's table: each backend's baseline, shm's bound and the memcpy from the KV itself."""
    from sage_infer.transport.bench import BASELINE_NAMES

    for name in backends:
        out.print(f"  baseline for {name}: {BASELINE_NAMES[name]}"
                  + (" (+ CRC32C: the same with a CRC of every chunk, as kv_transport.checksum=crc32c pays)"
                     if name == "shm" else ""))
    bounds = {(r.chunk_bytes, r.zero_copy): r.bound_gbps for r in results if r.bound_gbps}
    if bounds:
        fp16 = {(r.chunk_bytes, r.zero_copy): r.gbps for r in results if r.bound_gbps and r.ratio_to_as_stored == 1}
        out.print("  shm's bound, the copies alone (sender copy + CRC32C into the ring, receiver copy + CRC32C out; "
                  "zero-copy: the sender's copy, the receiver's CRC) in two processes synchronised by spinning: "
                  + ", ".join(f"{gbps:.2f} GB/s at {chunk >> 10} KiB{' zero-copy' if zc else ''}"
                              + (f" (as stored ÷ bound {fp16[chunk, zc] / gbps:.2f})" if (chunk, zc) in fp16 else "")
                              for (chunk, zc), gbps in bounds.items()))
    kv_memcpy = {r.chunk_bytes: r.kv_memcpy_gbps for r in results if r.kv_memcpy_gbps}
    if kv_memcpy:
        out.print("  the same memcpy from the transfer's own KV tensors (torch memory, no transparent huge pages): "
                  + ", ".join(f"{gbps:.2f} GB/s at {chunk >> 10} KiB" for chunk, gbps in kv_memcpy.items()))


@app.command("backends")
def backends(as_json: JsonOpt = False) -> None:
    """List KV transport backends, whether each can run here, and why not."""
    from sage_infer.transport.base import backend_availability

    statuses = backend_availability()
    emit({"transport_backends": [{"name": s.name, "available": s.available, "reason": s.reason} for s in statuses]},
         as_json,
         lambda c: c.print(table("Transport backends", ["backend", "available", "reason"],
                                 [(s.name, yes_no(s.available), s.reason or "-") for s in statuses])))
