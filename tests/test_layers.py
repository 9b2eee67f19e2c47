"""The library's modules form layers without circles: a lower module never imports a higher one, not even lazily.

A subpackage (``hfacc/objectives/``) is one layer to the modules outside it, and its own modules form layers too.
"""

import ast
from graphlib import CycleError, TopologicalSorter
from itertools import takewhile

from tests.helpers import ROOT

PACKAGE = ROOT / "hfacc"
SUBPACKAGES = [p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file() and p.name != "metrics"]


def imported_names(path, level: int) -> set[str]:
    """The names ``path`` imports at ``level`` dots (``from .x import`` -> x at 1), or absolutely as ``hfacc.x``."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level == level and node.module:
                found.add(node.module.split(".")[0])
            elif node.level == level:
                found.update(alias.name for alias in node.names)
            elif node.level == 0 and node.module and node.module.startswith("hfacc."):
                found.add(node.module.split(".")[1])
    return found


def is_node(name: str) -> bool:
    return (PACKAGE / f"{name}.py").is_file() or name in SUBPACKAGES


def import_graph() -> dict[str, set[str]]:
    """hfacc's top-level modules and subpackages, each with the ones it imports (at the top or inside a function)."""
    graph = {p.stem: {n for n in imported_names(p, 1) if is_node(n)} - {p.stem} for p in PACKAGE.glob("*.py")}
    graph.pop("__init__")
    for package in SUBPACKAGES:
        graph[package] = {n for p in (PACKAGE / package).glob("*.py") for n in imported_names(p, 2) if is_node(n)}
    return graph


def subpackage_graph(package: str) -> dict[str, set[str]]:
    folder = PACKAGE / package
    modules = {p.stem for p in folder.glob("*.py")} - {"__init__"}
    return {p.stem: (imported_names(p, 1) & modules) - {p.stem} for p in folder.glob("*.py") if p.stem in modules}


def test_no_import_circles():
    try:
        order = list(TopologicalSorter(import_graph()).static_order())
        for package in SUBPACKAGES:
            TopologicalSorter(subpackage_graph(package)).static_order()
    except CycleError as err:
        raise AssertionError(f"import circle: {' -> '.join(err.args[1])}") from None
    assert order.index("loss") < order.index("objectives") < order.index("trainer")


def test_the_math_and_the_kernel_import_no_training_machinery():
    graph = import_graph()
    assert graph["loss"] == set()
    assert graph["fused_loss"] <= {"loss", "model_io"}
    for low in ("loss", "model_io", "fused_loss", "objectives", "distributed", "window", "accumulation", "verify"):
        assert "trainer" not in graph[low], f"{low} imports trainer.py"


def test_readme_map_lists_every_module_in_layer_order():
    """README's repository map names each module once, each after every module it imports."""
    import re

    text = (ROOT / "README.md").read_text()
    start = text.index("```text\nhfacc/")
    tree = text[start : text.index("\nrecipes/", start)]
    order = re.findall(r"^  (\w+)(?:\.py|/)", tree, re.M)
    graph = import_graph()
    assert sorted(order) == sorted(graph)
    late = [(module, dep) for i, module in enumerate(order) for dep in graph[module] if dep not in order[:i]]
    assert not late, f"listed before what they import: {late}"
    for package in SUBPACKAGES:  # its modules, indented under it, in their own layer order
        lines = tree[tree.index(f"\n  {package}/") + 1 :].splitlines()[1:]
        block = takewhile(lambda line: line.startswith("    "), lines)
        inner = [m.group(1) for line in block if (m := re.match(r"^    (\w+)\.py", line))]
        local = subpackage_graph(package)
        assert sorted(inner) == sorted(local), f"{package}/: the map lists {inner}"
        late = [(m, d) for i, m in enumerate(inner) for d in local[m] if d not in inner[:i]]
        assert not late, f"{package}/: listed before what they import: {late}"
