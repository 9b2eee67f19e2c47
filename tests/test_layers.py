"""The library's modules form layers without circles: a lower module never imports a higher one, not even lazily."""

import ast
from graphlib import CycleError, TopologicalSorter

from tests.helpers import ROOT

PACKAGE = ROOT / "hfacc"


def internal_imports(path) -> set[str]:
    """The hfacc modules ``path`` imports, at the top or inside a function (``from .x import``, ``hfacc.x``)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1 and node.module:
                found.add(node.module.split(".")[0])
            elif node.level == 1:
                found.update(alias.name for alias in node.names)
            elif node.module and node.module.startswith("hfacc."):
                found.add(node.module.split(".")[1])
    return {name for name in found if (PACKAGE / f"{name}.py").is_file()}


def import_graph() -> dict[str, set[str]]:
    return {p.stem: internal_imports(p) - {p.stem} for p in PACKAGE.glob("*.py") if p.stem != "__init__"}


def test_no_import_circles():
    try:
        order = list(TopologicalSorter(import_graph()).static_order())
    except CycleError as err:
        raise AssertionError(f"import circle: {' -> '.join(err.args[1])}") from None
    assert order.index("loss") < order.index("objective") < order.index("trainer")


def test_the_math_and_the_kernel_import_no_training_machinery():
    graph = import_graph()
    assert graph["loss"] == set()
    assert graph["fused_loss"] <= {"loss", "model_io"}
    for low in ("loss", "model_io", "fused_loss", "objective", "distributed", "window", "accumulation", "verify"):
        assert "trainer" not in graph[low], f"{low}.py imports trainer.py"


def test_readme_map_lists_every_module_in_layer_order():
    """README's repository map names each module once, each after every module it imports."""
    import re

    text = (ROOT / "README.md").read_text()
    start = text.index("```text\nhfacc/")
    tree = text[start : text.index("\nrecipes/", start)]
    order = re.findall(r"^  (\w+)\.py", tree, re.M)
    graph = import_graph()
    assert sorted(order) == sorted(graph)
    late = [(module, dep) for i, module in enumerate(order) for dep in graph[module] if dep not in order[:i]]
    assert not late, f"listed before what they import: {late}"
