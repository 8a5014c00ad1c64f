"""The package layering of docs/architecture.md, checked on every import in the source.

Every `import sage_infer.X` / `from sage_infer.X import ...` anywhere in a module — at the
top, inside a function, under TYPE_CHECKING — counts: a function-level import that goes
upward is still a cycle, only hidden.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

import pytest

import sage_infer

PACKAGE = Path(sage_infer.__file__).parent

# Lowest first. A subpackage may import its own layer's modules only from itself, and any lower layer.
LAYERS: list[set[str]] = [
    {"errors", "tables", "core"},  # no sage_infer imports at all (errors, tables) or only each other
    {"interfaces"},  # contracts shared by the layers above: accelerator descriptor, transport plan, backend
    {"hal"},  # device detection and choice; knows nothing of config
    {"config"},  # pydantic configs, presets, resolution of every `auto`
    {"quantization"},  # KV codecs (pool, tiers, transport), weight-only quantization, calibration
    {"kv_policy"},  # eviction / migration policies: pure decisions, shared by runtime and simulator
    {"prefix_reuse"},  # chained hashes and the prefix index (drives a policy)
    {"transport"},  # KV transport engine: moves bytes described by the KV schema; knows no pool or engine
    {"kv_runtime"},  # the pool, blocks, admission and tiers (tiers may send through the transport)
    {"integrations"},  # sage inside other engines: the vLLM KV connector over hashing and tiers (imports vLLM lazily)
    {"layers", "sim"},  # attention over the pool API; the trace simulator above the runtime
    {"models"},
    {"pruning"},  # structured pruning of HF checkpoints (calibration from quantization, shapes from models)
    {"structured"},  # structured outputs: constraints compiled to grammars (llguidance), per-sequence matchers, masks
    {"spec_decode"},  # speculative proposers and the verifier (the scheduler asks, the engine verifies)
    {"scheduler"},
    {"engine"},
    {"backends"},  # InferenceBackend implementations (native wraps the engine)
    {"server", "serving_bench"},  # the HTTP front end sees backends only; the client bench sees nothing below
    {"router"},  # the prefill/decode router: HTTP to workers, the server's error and body helpers
    {"cli"},  # nothing imports cli
]
LAYER_OF = {name: i for i, layer in enumerate(LAYERS) for name in layer}

# Edges the layer order would allow but the design forbids.
FORBIDDEN: dict[str, set[str]] = {
    "server": {"engine", "scheduler", "kv_runtime", "models", "layers", "prefix_reuse", "kv_policy", "sim"},
    "serving_bench": {"engine", "scheduler", "kv_runtime", "models", "layers", "backends", "server"},
    # (kv_policy: the routing policies the router shares with fleet replay are pure decisions, like eviction's;
    # prefix_reuse: the router hashes token-id prompts as the replicas name their blocks)
    # (models: the tokenizer and config.json of the served model, to hash text prompts as the replicas do; never the
    # weights: tests/test_layering.py checks the router imports no torch)
    "router": {"engine", "scheduler", "kv_runtime", "layers", "sim", "backends", "transport"},
    "transport": {"engine", "scheduler", "models", "layers", "kv_runtime"},
    "sim": {"layers", "models", "engine"},
    # a backend drives an engine through its public API: the KV manager and the scheduler are the engine's
    "backends": {"kv_runtime", "scheduler", "prefix_reuse", "kv_policy", "layers", "spec_decode"},
}
# The registries of attention backends and step executors (name -> "module:Class" in that package), and the
# modules allowed to pick one by name: the registries' own defaults, the runner's reference default, and the one
# place that chooses (engine/build.py, from config/auto.py's values).
REGISTRIES = {"layers/attention_backends": ("DECODE_PARTS", "PREFILL_PARTS"), "engine/steps": ("STEP_EXECUTORS",)}
CHOOSERS = {"engine/build.py", "engine/model_runner.py", "layers/attention_backends/__init__.py"}
CHOOSING_CALLS = {"attention_backend", "step_executor", "AttentionBackend"}
ENGINE_INTERNALS = {"kv", "scheduler", "runner", "requests"}  # what `engine.<name>` a backend must not read
DATA_ONLY = {"demo_model", "presets"}  # folders of files, no Python


def unit_of(path: Path) -> str:
    """The subpackage (or top-level module) a source file belongs to."""
    parts = path.relative_to(PACKAGE).parts
    return parts[0] if len(parts) > 1 else parts[0].removesuffix(".py")


def imports_of(path: Path) -> list[tuple[int, str]]:
    """(line, imported sage_infer unit) for every import in the file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
            if node.module == "sage_infer":  # from sage_infer import errors
                names = [f"sage_infer.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level:  # resolve `from .x import y` to its absolute name
            package = list(path.relative_to(PACKAGE.parent).parts[:-1])
            base = package[: len(package) - (node.level - 1)]
            names = [".".join([*base, node.module] if node.module else base)]
        for name in names:
            parts = name.split(".")
            if parts[0] == "sage_infer" and len(parts) > 1 and not parts[1].startswith("__"):
                found.append((node.lineno, parts[1]))
    return found


def edges() -> dict[tuple[str, str], list[str]]:
    """(importer unit, imported unit) -> the file:line of each such import."""
    out: dict[tuple[str, str], list[str]] = defaultdict(list)
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == PACKAGE / "__init__.py":
            continue  # the package root re-exports the public API from the top
        source = unit_of(path)
        for line, target in imports_of(path):
            if target != source:
                out[source, target].append(f"{path.relative_to(PACKAGE.parent)}:{line}")
    return out


def test_every_subpackage_has_a_layer():
    units = {unit_of(p) for p in PACKAGE.rglob("*.py") if p != PACKAGE / "__init__.py"}
    assert units - set(LAYER_OF) == set(), "add the new subpackage to LAYERS (and docs/architecture.md)"
    assert DATA_ONLY.isdisjoint(units)


def test_no_import_goes_up_a_layer_or_across_one():
    wrong = []
    for (source, target), where in edges().items():
        if LAYER_OF[target] > LAYER_OF[source]:
            wrong.append(f"{source} (layer {LAYER_OF[source]}) imports {target} (layer {LAYER_OF[target]}): {where}")
        elif LAYER_OF[target] == LAYER_OF[source]:
            wrong.append(f"{source} imports {target} of its own layer: {where}")
    assert wrong == []


@pytest.mark.parametrize("source", sorted(FORBIDDEN))
def test_forbidden_edges(source):
    wrong = {target: where for (s, target), where in edges().items() if s == source and target in FORBIDDEN[source]}
    assert wrong == {}


def test_nothing_imports_cli():
    assert [(s, w) for (s, t), w in edges().items() if t == "cli"] == []


def test_core_imports_nothing_else_of_sage_infer():
    assert [(t, w) for (s, t), w in edges().items() if s == "core"] == []


def test_no_cycles_between_subpackages():
    graph: dict[str, set[str]] = defaultdict(set)
    for source, target in edges():
        graph[source].add(target)
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    cycles = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, [*stack, nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert cycles == []


def test_the_checker_sees_function_level_imports(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from sage_infer.engine.llm import LLM\n    import sage_infer.cli.main\n")
    assert imports_of(module) == [(2, "engine"), (3, "cli")]


def test_the_checker_resolves_relative_imports():
    assert (23, "hal") in imports_of(PACKAGE / "hal" / "topology" / "__init__.py")


def test_only_build_chooses_an_attention_backend_or_a_step_executor():
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        where = path.relative_to(PACKAGE).as_posix()
        if where in CHOOSERS:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in CHOOSING_CALLS:
                wrong.append(f"{where}:{node.lineno} calls {node.func.id}")
    assert wrong == []


def registered_parts() -> dict[str, tuple[str, set[str]]]:
    """Every registered attention part and step executor: its file, and the classes that file defines."""
    parts = {}
    for package, tables in REGISTRIES.items():
        source = (PACKAGE / package / "__init__.py").read_text(encoding="utf-8")
        for node in ast.parse(source).body:
            target = getattr(node, "target", None) or (node.targets[0] if isinstance(node, ast.Assign) else None)
            if isinstance(target, ast.Name) and target.id in tables:
                for entry in ast.literal_eval(node.value).values():
                    module = f"{package}/{entry.split(':')[0]}.py"
                    tree = ast.parse((PACKAGE / module).read_text(encoding="utf-8"))
                    parts[module] = (package, {n.name for n in tree.body if isinstance(n, ast.ClassDef)})
    return parts


def test_a_backend_or_executor_is_named_only_in_its_own_file_and_its_registry():
    """Adding an attention part or a step executor is one new file and one registry line: nothing else in the
    package names its classes (the runner, the model, the metadata and the other parts know none of them)."""
    parts = registered_parts()
    assert len(parts) == 9  # 2 decode parts, 3 prefill parts, 4 step executors
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        where = path.relative_to(PACKAGE).as_posix()
        text = path.read_text(encoding="utf-8")
        for module, (package, classes) in parts.items():
            if where in (module, f"{package}/__init__.py"):
                continue
            wrong += [f"{where} names {name} ({module})" for name in sorted(classes)
                      if re.search(rf"\b{name}\b", text)]
    assert wrong == []


def test_backends_read_no_engine_internals():
    """`NativeBackend` (and any other) uses the engine's public API: never `engine.kv`, `engine.scheduler`..."""
    wrong = []
    for path in sorted((PACKAGE / "backends").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (isinstance(node, ast.Attribute) and node.attr in ENGINE_INTERNALS
                    and isinstance(node.value, ast.Attribute | ast.Name)
                    and (node.value.attr if isinstance(node.value, ast.Attribute) else node.value.id) == "engine"):
                wrong.append(f"{path.name}:{node.lineno} reads engine.{node.attr}")
    assert wrong == []


def test_the_router_imports_no_torch():
    """A router process holds no model: it tokenizes with the model's tokenizer and never loads torch."""
    import subprocess
    import sys

    code = ("import sys; import sage_infer.router.app, sage_infer.router.fleet, sage_infer.router.local_prompts, "
            "sage_infer.router.replicas, sage_infer.router.launch, sage_infer.router.supervise; "
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0
