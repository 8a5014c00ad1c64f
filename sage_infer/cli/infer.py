"""`sage infer ...`: inference backends and hardware/transport presets."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from sage_infer.cli.options import JsonOpt
from sage_infer.cli.output import emit, table, yes_no
from sage_infer.config.hardware import numeric_leaf_paths
from sage_infer.config.presets import (
    list_presets,
    load_hardware_preset,
    load_preset_source,
    load_transport_preset,
)
from sage_infer.errors import UsageError

app = typer.Typer(help="Inference backends and presets.", no_args_is_help=True)

KindOpt = Annotated[
    Optional[str], typer.Option("--kind", help="hardware or transport (default: hardware, then transport).")
]


@app.command("backends:list")
def backends_list(as_json: JsonOpt = False) -> None:
    """List inference backends, whether each can run here, and why not."""
    from rich.markup import escape

    from sage_infer.backends.registry import list_backends

    statuses = list_backends()
    emit(
        {"backends": [s.to_dict() for s in statuses]},
        as_json,
        lambda c: c.print(
            table("Inference backends", ["backend", "available", "version", "reason / description"],
                  [(s.name, yes_no(s.available), escape(s.version or "-"), escape(s.reason or s.description))
                   for s in statuses])
        ),
    )


@app.command("presets:list")
def presets_list(as_json: JsonOpt = False) -> None:
    """List shipped hardware and transport presets."""
    hardware = [load_hardware_preset(name).profile for name in list_presets("hardware")]
    transport = [load_transport_preset(name).preset for name in list_presets("transport")]
    data = {
        "hardware": [
            {"name": p.name, "vendor": p.vendor.value, "description": p.description,
             "hbm_gb": p.memory.hbm_gb, "intra_node_link": p.intra_node_link.kind,
             "kv_default_dtype": p.kv.default_dtype.value}
            for p in hardware
        ],
        "transport": [{"name": t.name, "description": t.description, **t.values()} for t in transport],
    }

    def render(console) -> None:
        columns = ["name", "vendor", "HBM GB", "intra-node link", "KV dtype", "description"]
        console.print(table("Hardware presets", columns,
                            [(h["name"], h["vendor"], h["hbm_gb"], h["intra_node_link"], h["kv_default_dtype"],
                              h["description"]) for h in data["hardware"]]))
        console.print(table("Transport presets", ["name", "description"],
                            [(t["name"], t["description"]) for t in data["transport"]]))

    emit(data, as_json, render)


def _kind_of(name_or_path: str, kind: str | None) -> str:
    if kind is not None:
        if kind not in ("hardware", "transport"):
            raise UsageError(f"--kind {kind!r}: expected hardware or transport")
        return kind
    if name_or_path in list_presets("transport") and name_or_path not in list_presets("hardware"):
        return "transport"
    if Path(name_or_path).suffix in (".yaml", ".yml") and Path(name_or_path).exists():
        data = load_preset_source("hardware", name_or_path).data
        return "transport" if "kv_transport" in data else "hardware"
    return "hardware"


@app.command("presets:show")
def presets_show(name: str, kind: KindOpt = None, as_json: JsonOpt = False) -> None:
    """Show one preset's values, each with its source and confidence."""
    if _kind_of(name, kind) == "transport":
        loaded_t = load_transport_preset(name)
        data = {"kind": "transport", "file": str(loaded_t.source.path),
                **loaded_t.preset.model_dump(mode="json", exclude_unset=True)}
        emit(data, as_json, lambda c: c.print(table(
            f"Transport preset {loaded_t.preset.name}", ["field", "value"],
            [(k, v) for k, v in loaded_t.preset.values().items()])))
        return
    loaded = load_hardware_preset(name)
    profile = loaded.profile
    fields = []
    for dotted in numeric_leaf_paths(profile):
        value = _get(profile.model_dump(mode="json"), dotted)
        source = profile.sources.get(dotted)
        fields.append({"field": dotted, "value": value,
                       "confidence": source.confidence.value if source else "unspecified",
                       "ref": source.ref if source else ""})
    data = {"kind": "hardware", "file": str(loaded.source.path), "extends_chain": loaded.source.chain,
            "profile": profile.model_dump(mode="json"), "numbers": fields}

    def render(console) -> None:
        console.print(f"[bold]{profile.name}[/bold] ({profile.vendor.value}): {profile.description}")
        console.print(f"device: {profile.device.torch_device_type} via {profile.device.python_module}, "
                      f"dist {profile.device.distributed_backend}; KV dtypes "
                      f"{', '.join(d.value for d in profile.kv.dtypes)} (default {profile.kv.default_dtype.value}); "
                      f"transport {' > '.join(profile.transport.backends)}")
        console.print(table("Numbers", ["field", "value", "confidence", "source"],
                            [(f["field"], f["value"], f["confidence"], f["ref"]) for f in fields]))

    emit(data, as_json, render)


@app.command("presets:validate")
def presets_validate(file: Path, kind: KindOpt = None, as_json: JsonOpt = False) -> None:
    """Check a preset file; prints one line naming file, line and field when it is wrong."""
    chosen = _kind_of(str(file), kind)
    loaded = load_transport_preset(str(file)) if chosen == "transport" else load_hardware_preset(str(file))
    data = {"file": str(file), "kind": chosen, "valid": True, "extends_chain": loaded.source.chain}
    emit(data, as_json, lambda c: c.print(f"[green]ok[/green]: {file} is a valid {chosen} preset"
                                          + (f" (extends {' -> '.join(loaded.source.chain[1:])})"
                                             if len(loaded.source.chain) > 1 else "")))


def _get(tree: dict, dotted: str) -> object:
    node: object = tree
    for part in dotted.split("."):
        node = node[int(part)] if isinstance(node, list) else node[part]
    return node
