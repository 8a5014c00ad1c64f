"""`sage kv ...`: KV-cache policy experiments on real request traces.

`replay` runs a Mooncake trace through the production prefix index and block manager
with each eviction policy, next to Belady's OPT and the infinite-cache ideal, on one
device tier or a device + host/disk/remote hierarchy (see docs/kv_replay.md).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Annotated, Optional

import typer

from sage_infer.errors import NotAvailableError, UsageError

app = typer.Typer(help="KV-cache policy experiments on request traces.", no_args_is_help=True)

_NUMBER = r"[0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?"
_SPEC = re.compile(rf"([+-]?{_NUMBER})\s*(%|[kmg]?tok|[kmgt]i?b|b)?")
_TOKEN_SCALE = {"tok": 1, "ktok": 1e3, "mtok": 1e6, "gtok": 1e9}
_BYTE_SCALE = {"b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
TIER_ORDER = ("device", "host", "disk", "remote")


@app.callback()
def _kv() -> None:
    """KV-cache policy experiments on request traces."""


def capacity_blocks(spec: str, distinct: int, block_bytes: int, flag: str = "--capacity") -> int:
    """Blocks for one capacity: `5%` of distinct blocks, `9000` blocks, `4.6Mtok` tokens or `2GiB` bytes."""
    from sage_infer.sim.tiered import TRACE_BLOCK_TOKENS

    match = _SPEC.fullmatch(spec.strip().lower())
    if match is None:
        raise UsageError(f"{flag} {spec!r}: expected a percent of distinct blocks (5%), blocks (9000), "
                         "tokens (4.6Mtok) or bytes (2GiB)")
    value, unit = float(match.group(1)), match.group(2)
    if not value > 0:
        raise UsageError(f"{flag} {spec!r}: capacity must be > 0")
    if unit is None:
        if value != int(value):
            raise UsageError(f"{flag} {spec!r}: a block count must be a whole number")
        blocks = int(value)
    elif unit == "%":
        blocks = round(distinct * value / 100)
    elif unit in _TOKEN_SCALE:
        blocks = int(value * _TOKEN_SCALE[unit] // TRACE_BLOCK_TOKENS)
    else:
        blocks = int(value * _BYTE_SCALE[unit] // block_bytes)
    if blocks < 1:
        raise UsageError(f"{flag} {spec!r} is less than one block",
                         hint=f"a block is {TRACE_BLOCK_TOKENS} tokens, {block_bytes / 2**20:.0f} MiB of KV; "
                              f"the trace has {distinct} distinct blocks")
    return blocks


def parse_tiers(text: str) -> list[tuple[str, str]]:
    """`device=5%,host=25%,disk=100%` -> [(tier, capacity spec)], checked for names and order."""
    tiers: list[tuple[str, str]] = []
    for item in text.split(","):
        name, sep, spec = item.strip().partition("=")
        name = name.strip().lower()
        if not sep or not spec.strip():
            raise UsageError(f"--tiers {text!r}: {item.strip()!r} is not TIER=CAPACITY",
                             hint="e.g. --tiers device=5%,host=25%,disk=100%")
        if name not in TIER_ORDER:
            raise UsageError(f"--tiers: unknown tier {name!r}; expected {', '.join(TIER_ORDER)}")
        if tiers and TIER_ORDER.index(name) <= TIER_ORDER.index(tiers[-1][0]):
            raise UsageError(f"--tiers: {name} after {tiers[-1][0]}; list each tier once, fastest first "
                             f"({' > '.join(TIER_ORDER)})")
        tiers.append((name, spec.strip()))
    return tiers


def resolve_policies(text: str) -> tuple[list[str], list[str]]:
    """Policy names to replay and notes about skipped ones; unknown names are a UsageError."""
    from sage_infer.kv_policy.base import POLICIES
    from sage_infer.sim.tiered import all_policies

    names = [n.strip().lower() for n in text.split(",") if n.strip()]
    if not names:
        raise UsageError("--policy is empty; give names (lru,arc) or all")
    if "all" in names:
        return all_policies(), []
    for name in names:
        if name == "opt":
            raise UsageError("--policy opt: OPT is always reported next to the policies; it is not a --policy")
        if name not in POLICIES:
            known = ", ".join(all_policies())
            raise UsageError(f"--policy: unknown eviction policy {name!r}; known: {known}, or all")
    return list(dict.fromkeys(names)), []


@app.command("replay")
def replay_command(
    trace: Annotated[Path, typer.Argument(help="Mooncake JSONL trace (timestamp, input_length, hash_ids).")],
    capacity: Annotated[
        Optional[str], typer.Option("--capacity", help="Device capacity, comma-separated for a sweep: 5% of "
                                    "distinct blocks, 9000 blocks, 4.6Mtok tokens, 2GiB bytes. (default 5%)")
    ] = None,
    policy: Annotated[str, typer.Option("--policy", help="Comma-separated policies, or all.")] = "lru",
    tiers: Annotated[
        Optional[str], typer.Option("--tiers", help="Tier capacities, fastest first: device=5%,host=25%,disk=100% "
                                    "(device may be left to --capacity).")
    ] = None,
    preset: Annotated[
        Optional[str], typer.Option("--preset", "-p", help="Hardware preset: prices hits in prefill seconds and "
                                    "decides demotions (load vs recompute).")
    ] = None,
    max_requests: Annotated[
        Optional[int], typer.Option("--max-requests", min=1, help="Replay only the first N requests.")
    ] = None,
    json_out: Annotated[
        Optional[str], typer.Option("--json", metavar="OUT", help="Write the results as JSON to OUT ('-': print "
                                    "JSON instead of tables).")
    ] = None,
    plot: Annotated[
        Optional[Path], typer.Option("--plot", dir_okay=False, help="Save hit rate vs capacity curves as a PNG.")
    ] = None,
    replicas: Annotated[
        Optional[str], typer.Option("--replicas", help="Replay through a fleet of N replicas (comma-separated for "
                                    "several N), each with --capacity of device KV, behind --routing.")
    ] = None,
    routing: Annotated[
        str, typer.Option("--routing", help="With --replicas: comma-separated routing policies (kv, round-robin, "
                          "random, least-load, session).")
    ] = "kv,round-robin",
    prefill_tok_s: Annotated[
        float, typer.Option("--prefill-tok-s", min=1.0, help="With --replicas: prompt tokens one replica computes "
                            "per second (the time model of queues and TTFT).")
    ] = 4000.0,
) -> None:
    """Replay a trace through the prefix cache with each policy, next to OPT and the ideal (or, with --replicas,
    through a fleet of replicas behind each routing policy, next to one replica holding the fleet's KV)."""
    from sage_infer.kv_policy.cost_benefit import CostBenefitModel
    from sage_infer.sim.replay import distinct_blocks, load_mooncake
    from sage_infer.sim.tiered import run_capacity

    tier_specs = parse_tiers(tiers) if tiers is not None else []
    if tier_specs and tier_specs[0][0] == "device" and capacity is not None:
        raise UsageError("the device capacity is given twice (--capacity and --tiers device=...); give one")
    policies, notes = resolve_policies(policy)
    for flag, out in (("--json", None if json_out in (None, "-") else Path(json_out)), ("--plot", plot)):
        if out is not None and not out.parent.is_dir():  # fail now, not after the replay
            raise UsageError(f"{flag} {out}: directory {out.parent} does not exist")
    if plot is not None:
        _require_matplotlib()
    cost = None
    if preset is not None:
        from sage_infer.config.presets import load_hardware_preset

        cost = CostBenefitModel(load_hardware_preset(preset).profile)

    requests = load_mooncake(trace)[:max_requests]
    distinct = distinct_blocks(requests)
    if replicas is not None:
        _replay_fleet(requests, str(trace), replicas, routing, capacity, tier_specs, policies, distinct, prefill_tok_s,
                      json_out)
        return
    capacities, lower = _capacities(capacity, tier_specs, distinct)
    documents = []
    for blocks in capacities:
        document, run_notes = run_capacity(requests, str(trace), blocks, policies, lower, cost)
        documents.append(document)
        notes.extend(n for n in run_notes if n not in notes)
    output = documents[0] if len(documents) == 1 else {"capacities": documents}
    _emit(output, json_out, [_table(document, cost is not None) for document in documents])
    for note in notes:
        typer.echo(f"note: {note}", err=True)
    if plot is not None:
        _plot(plot, documents)


def _replay_fleet(requests, trace: str, replicas: str, routing: str, capacity: str | None, tier_specs, policies,
                  distinct: int, prefill_tok_s: float, json_out: str | None) -> None:
    """`--replicas N[,M...]`: the fleet replay (`sim.fleet`), one table."""
    from sage_infer.kv_policy.routing import ROUTING_POLICIES
    from sage_infer.sim.fleet import run_fleet

    if tier_specs:
        raise UsageError("--replicas replays device caches only: lower tiers in a fleet replay are not implemented "
                         "yet; leave out --tiers")
    if len(policies) != 1:
        raise UsageError("--replicas: give one eviction --policy (each replica runs it)")
    counts = []
    for item in replicas.split(","):
        if not item.strip().isdigit() or not 1 <= int(item) <= 4096:
            raise UsageError(f"--replicas {replicas!r}: expected replica counts 1-4096, comma-separated (8,64)")
        counts.append(int(item))
    routings = [r.strip() for r in routing.split(",") if r.strip()]
    for name in routings or [""]:
        if name not in ROUTING_POLICIES:
            raise UsageError(f"--routing {name!r}: expected one of {', '.join(ROUTING_POLICIES)}")
    if capacity is not None and "," in capacity:
        raise UsageError("--replicas: give one --capacity (each replica's device KV)")
    [blocks], _ = _capacities(capacity, [], distinct)
    document = run_fleet(requests, trace, counts, routings, blocks, policies[0], prefill_tok_s)
    _emit(document, json_out, [_fleet_table(document, trace, blocks, distinct, policies[0], prefill_tok_s)])


def _capacities(capacity: str | None, tier_specs: list[tuple[str, str]], distinct: int):
    """The device capacities to sweep, in blocks (`--capacity`, or `--tiers device=`), and the lower `TierSpec`s."""
    from sage_infer.sim.tiered import TRACE_BLOCK_BYTES, TierSpec

    block_bytes = TRACE_BLOCK_BYTES
    if tier_specs and tier_specs[0][0] == "device":
        device_specs, tier_specs = [tier_specs[0][1]], tier_specs[1:]
    else:
        device_specs = (capacity or "5%").split(",")
    capacities = [capacity_blocks(s, distinct, block_bytes) for s in device_specs]
    lower = [TierSpec(name, capacity_blocks(spec, distinct, block_bytes, f"--tiers {name}="))
             for name, spec in tier_specs]
    return capacities, lower


def _emit(output: dict, json_out: str | None, tables: list) -> None:
    """`--json -`: the JSON on stdout instead of the tables; `--json OUT`: written to OUT, the tables printed too."""
    if json_out == "-":
        from sage_infer.cli.output import emit

        emit(output, True, lambda console: None)
        return
    from sage_infer.cli.output import console

    if json_out is not None:
        Path(json_out).write_text(json.dumps(output, indent=2) + "\n", encoding="utf-8")
    for rendered in tables:
        console.print(rendered)


def _fleet_table(document: dict, trace: str, blocks: int, distinct: int, policy: str, prefill_tok_s: float):
    from sage_infer.cli.output import table

    rows = []
    for r in document["results"]:
        one = document["one_replica"][str(r["replicas"])]
        ratio = r["hit_rate_vs_one_replica"]
        rows.append([str(r["replicas"]), r["routing"], _pct(r["prefix_hit_rate"]), _pct(one["prefix_hit_rate"]),
                     "—" if ratio is None else f"{ratio:.3f}", f"{r['compute_imbalance']:.2f}",
                     f"{r['routed_imbalance']:.2f}", f"{r['ttft_s']['p50']:.2f} / {r['ttft_s']['p90']:.2f}",
                     _pct(r["prediction_error"]) if r["routing"] == "kv" else "—"])
    title = (f"{trace}: {document['requests']} requests through N replicas of {blocks} device blocks each "
             f"({blocks / distinct * 100:.1f}% of {distinct} distinct), {policy} eviction, "
             f"{prefill_tok_s:g} prefill tok/s per replica")
    return table(title, ["N", "routing", "prefix hit rate", "one replica, N x KV", "÷ one replica",
                         "compute max/mean", "requests max/mean", "TTFT p50 / p90 (s)", "prediction error"], rows)


def _pct(rate: float | None) -> str | None:
    return None if rate is None else f"{rate * 100:.2f}%"


def _table(document: dict, priced: bool):
    from sage_infer.cli.output import table

    opt = document["opt"]
    opt_prefix = opt["prefix_hit_rate"] if opt else None
    prefetched = any(r.get("prefetch") for r in document["results"])  # with lower tiers
    rows = []
    for r in document["results"]:
        ratio = f"{r['prefix_hit_rate'] / opt_prefix:.3f}" if opt_prefix else "—"
        tiers = " ".join(f"{tier}={n}" for tier, n in r["tier_hits"].items())
        saved = "—" if r["prefill_seconds_saved"] is None else f"{r['prefill_seconds_saved']:.1f}"
        row = [r["policy"], _pct(r["hit_rate"]), _pct(r["prefix_hit_rate"]), ratio, tiers, saved]
        if prefetched:
            p = r["prefetch"]
            row.append(f"{_pct(p['hit_ratio'])} / {p['bytes_wasted'] / 2**30:.1f} GiB")
        rows.append([*row, f"{r['us_per_access']:.2f}"])
    pad = [""] * prefetched
    rows.append(["OPT", _pct(opt["hit_rate"]) if opt else "null", _pct(opt_prefix) if opt else "null",
                 "1.000" if opt_prefix else "—", "", "", *pad, ""])
    rows.append(["ideal (∞)", _pct(document["ideal_hit_rate"]), _pct(document["ideal_hit_rate"]), "", "", "", *pad,
                 ""])
    share = document["capacity_blocks"] / document["distinct"] * 100 if document["distinct"] else 0.0
    title = (f"{document['trace']}: {document['requests']} requests, {document['accesses']} block accesses, "
             f"{document['distinct']} distinct; device {document['capacity_blocks']} blocks ({share:.1f}%)")
    columns = ["policy", "hit rate", "prefix hit rate", "÷ OPT (prefix)", "tier hits",
               "prefill s saved" if priced else "prefill s saved (no --preset)",
               *(["prefetch hit / wasted"] * prefetched), "µs/access"]
    return table(title, columns, rows)


def _require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise NotAvailableError("--plot needs matplotlib", hint="pip install matplotlib") from None


def _plot(path: Path, documents: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    documents = sorted(documents, key=lambda d: d["capacity_blocks"])
    x = [d["capacity_blocks"] / d["distinct"] * 100 for d in documents]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in dict.fromkeys(r["policy"] for d in documents for r in d["results"]):
        y = [next(r["hit_rate"] for r in d["results"] if r["policy"] == name) * 100 for d in documents]
        ax.plot(x, y, marker="o", label=name)
    if all(d["opt"] for d in documents):
        ax.plot(x, [d["opt"]["hit_rate"] * 100 for d in documents], marker="s", color="black", label="OPT")
    ax.axhline(documents[0]["ideal_hit_rate"] * 100, linestyle="--", color="grey", label="ideal (∞ cache)")
    ax.set_xlabel("device capacity (% of distinct blocks)")
    ax.set_ylabel("block hit rate (%)")
    ax.set_title(Path(documents[0]["trace"]).name)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
