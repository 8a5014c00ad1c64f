"""No function in sage_infer/ is longer than 80 lines, counted from its ``def`` to the end of its body: a longer
one is several functions. Those still being split are listed by name, and the list only shrinks."""

from __future__ import annotations

import ast
from pathlib import Path

MAX_LINES = 80
PACKAGE = Path(__file__).resolve().parent.parent / "sage_infer"

# Functions over MAX_LINES that are being split into named steps (none now). Remove an entry in the change that
# splits it: test_every_allowed_function_is_still_too_long fails once one is gone or short enough.
ALLOWED_LONG: set[str] = set()


def lengths_in(tree: ast.AST, prefix: str = "") -> dict[str, int]:
    """Each function and method in `tree` (nested ones too) by qualified name, and its lines from ``def`` to the
    end of its body (decorators not counted); a name defined twice keeps its longer definition."""
    lengths: dict[str, int] = {}

    def walk(node: ast.AST, scope: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                name = scope + child.name
                lengths[name] = max(lengths.get(name, 0), child.end_lineno - child.lineno + 1)
                walk(child, name + ".")
            elif isinstance(child, ast.ClassDef):
                walk(child, scope + child.name + ".")
            else:
                walk(child, scope)

    walk(tree, prefix)
    return lengths


def package_lengths() -> dict[str, int]:
    """Every function under sage_infer/, as ``path::qualified.name``."""
    lengths: dict[str, int] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        where = path.relative_to(PACKAGE.parent).as_posix()
        lengths.update(lengths_in(ast.parse(path.read_text(encoding="utf-8"), str(path)), f"{where}::"))
    return lengths


def test_no_function_in_the_package_is_longer_than_80_lines():
    lengths = package_lengths()
    assert len(lengths) > 500, "the walk found too few functions: is PACKAGE the package?"
    too_long = {name: n for name, n in lengths.items() if n > MAX_LINES and name not in ALLOWED_LONG}
    assert not too_long, f"functions over {MAX_LINES} lines (split each into named steps):\n" + "\n".join(
        f"  {name}: {n} lines" for name, n in sorted(too_long.items()))


def test_every_allowed_function_is_still_too_long():
    lengths = package_lengths()
    done = {name: lengths.get(name) for name in ALLOWED_LONG if lengths.get(name, 0) <= MAX_LINES}
    assert not done, "remove from ALLOWED_LONG (gone, or now short enough):\n" + "\n".join(
        f"  {name}: {'no longer exists' if n is None else f'{n} lines'}" for name, n in sorted(done.items()))


def test_a_function_is_measured_from_its_def_to_the_end_of_its_body_methods_and_nested_ones_too():
    source = '''
@decorator
def outer():
    def inner():
        return 1
    return inner


class Model:
    async def forward(self):
        x = 1

        return x
'''
    assert lengths_in(ast.parse(source)) == {"outer": 4, "outer.inner": 2, "Model.forward": 4}
