"""hfacc's folders are layers: a folder imports only from the folders below it and from itself, never from one above
it (not even lazily), and the modules of a folder form no import circle.

The order is the one ``hfacc/__init__.py``'s docstring states (lowest first); this file reads it from there and every
``import`` of every module, so the docstring, the tree and the imports cannot drift apart.
"""

import ast
import re
from graphlib import CycleError, TopologicalSorter
from itertools import takewhile

import pytest

from tests.helpers import ROOT

PACKAGE = ROOT / "hfacc"
NOT_CODE = {"metrics"}  # the exact-match metric module evaluate loads from its path: no hfacc import


def get_layer_order() -> list[str]:
    """The folders (and top-level modules, ``cli.py``) as ``hfacc/__init__.py``'s docstring lists them, lowest first."""
    doc = ast.get_docstring(ast.parse((PACKAGE / "__init__.py").read_text()))
    return re.findall(r"^    (\w+)(?:\.py)?  ", doc, re.M)


def get_folders() -> list[str]:
    return sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file() and p.name not in NOT_CODE)


def module_name(path) -> str:
    """``hfacc/data/sft.py`` -> ``data.sft``; ``hfacc/cli.py`` -> ``cli``; a folder's ``__init__`` -> its name."""
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path) -> set[str]:
    """The hfacc modules ``path`` imports (at the top or inside a function), as ``folder.module`` names: a name
    imported from a folder's ``__init__`` counts as that folder."""
    here = module_name(path).split(".")
    package = here if path.name == "__init__.py" else here[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)] if node.level > 1 else package
                target = [*base, *(node.module.split(".") if node.module else [])]
            elif node.module and node.module.startswith("hfacc."):
                target = node.module.split(".")[1:]
            else:
                continue
            if node.module is None:  # from . import x: the modules themselves
                found.update(".".join([*target, alias.name]) for alias in node.names)
            elif target:
                found.add(".".join(target))
        elif isinstance(node, ast.Import):
            found.update(a.name.split(".", 1)[1] for a in node.names if a.name.startswith("hfacc."))
    return found - {module_name(path)}


def get_module_graph() -> dict[str, set[str]]:
    """Every hfacc module (``hfacc/__init__.py`` aside) with the hfacc modules it imports."""
    return {
        module_name(p): imported_modules(p)
        for p in PACKAGE.rglob("*.py")
        if p != PACKAGE / "__init__.py" and not NOT_CODE & set(p.relative_to(PACKAGE).parts)
    }


def layer_of(module: str) -> str:
    return module.split(".")[0]


def get_layer_violations(graph: dict[str, set[str]], order: list[str]) -> list[str]:
    """``module -> imported`` for every import of a layer above the importer's (or of one the order does not name)."""
    rank = {layer: i for i, layer in enumerate(order)}
    found = []
    for module, imports in sorted(graph.items()):
        for target in sorted(imports):
            here, there = rank.get(layer_of(module)), rank.get(layer_of(target))
            if here is None or there is None or there > here:
                found.append(f"{module} -> {target}")
    return found


def folder_graph(graph: dict[str, set[str]], folder: str) -> dict[str, set[str]]:
    """The modules of ``folder`` (``__init__`` aside) with the modules of the same folder each imports."""
    inside = {m for m in graph if layer_of(m) == folder and m != folder}
    return {m.split(".", 1)[1]: {t.split(".", 1)[1] for t in graph[m] & inside} for m in inside}


def test_the_docstring_names_every_folder_once_in_a_layer_order():
    order = get_layer_order()
    assert len(order) == len(set(order)), order
    assert sorted(set(order) - {"cli"}) == get_folders(), "hfacc/__init__.py's layers and hfacc's folders differ"
    assert order[-1] == "cli" and (PACKAGE / "cli.py").is_file()
    assert not [p.name for p in PACKAGE.glob("*.py") if p.stem not in ("__init__", "cli")], "modules outside folders"


def test_no_folder_imports_from_a_folder_above_it():
    violations = get_layer_violations(get_module_graph(), get_layer_order())
    assert not violations, "imports from a layer above (hfacc/__init__.py lists the order):\n" + "\n".join(violations)


def test_the_layer_check_fails_on_an_import_from_above():
    """Negative control: the check sees a lower folder importing an upper one, lazily or not, and a folder the
    order does not name."""
    order = get_layer_order()
    graph = get_module_graph()
    assert get_layer_violations(graph, order) == []
    graph["ops.loss"] = graph["ops.loss"] | {"training.trainer"}
    graph["data.padding_free"] = graph["data.padding_free"] | {"setup.layout_check"}
    graph["extra.module"] = {"ops.loss"}
    assert get_layer_violations(graph, order) == [
        "data.padding_free -> setup.layout_check",
        "extra.module -> ops.loss",
        "ops.loss -> training.trainer",
    ]
    # And the parser of imports itself: a lazy import inside a function, relative two levels up, is read.
    source = PACKAGE / "data" / "padding_free.py"
    assert "ops.model_io" in imported_modules(source)


@pytest.mark.parametrize("folder", get_folders())
def test_the_modules_of_a_folder_form_no_circle(folder):
    local = folder_graph(get_module_graph(), folder)
    try:
        list(TopologicalSorter(local).static_order())
    except CycleError as err:
        raise AssertionError(f"import circle in hfacc/{folder}/: {' -> '.join(err.args[1])}") from None


def test_the_math_and_the_kernels_import_no_training_machinery():
    graph = get_module_graph()
    assert graph["ops.loss"] == set()
    assert graph["ops.fused_loss"] <= {"ops.loss", "ops.model_io"}
    for module, imports in graph.items():
        if layer_of(module) in ("ops", "runtime", "data", "models", "objectives", "setup"):
            assert not {t for t in imports if layer_of(t) in ("training", "verify", "jobs", "cli")}, module


def test_a_micro_batch_enters_the_padding_free_check_only_in_setup():
    """The per-micro-batch layout (data) and the once-per-model check (setup) are apart: the trainer's compute_loss
    reaches the layout, and only the model setup reaches the check."""
    graph = get_module_graph()
    assert "setup.layout_check" not in graph["data.padding_free"]
    assert "data.padding_free" in graph["training.trainer"]
    users = {m for m, imports in graph.items() if "setup.layout_check" in imports}
    assert users <= {"setup.model_setup", "training.trainer"}, users
    trainer = (PACKAGE / "training" / "trainer.py").read_text()
    compute_loss = trainer[trainer.index("    def compute_loss(") : trainer.index("    def log(")]
    layout = trainer[trainer.index("    def _layout(") : trainer.index("    def _get_num_items_in_batch(")]
    assert "self._layout(" in compute_loss and "remove_padding(" in layout and "lay_out(" in layout
    assert not re.search(r"check_\w+\(|choose_\w+\(", layout)
    assert not re.search(r"check_\w+\(|choose_padding_free|require_packing_support", compute_loss)


def test_contributing_map_lists_every_folder_and_module_in_layer_order():
    """CONTRIBUTING.md's repository map names each folder in the order of the layers, and under it each module once,
    each after every module of its folder it imports."""
    text = (ROOT / "CONTRIBUTING.md").read_text()
    start = text.index("```text\nhfacc/")
    tree = text[start : text.index("\nrecipes/", start)]
    listed = re.findall(r"^  (\w+)(?:\.py|/)", tree, re.M)
    assert listed == get_layer_order()
    graph = get_module_graph()
    for folder in get_folders():
        lines = tree[tree.index(f"\n  {folder}/") + 1 :].splitlines()[1:]
        block = takewhile(lambda line: line.startswith("    "), lines)
        inner = [m.group(1) for line in block if (m := re.match(r"^    (\w+)\.py", line))]
        local = folder_graph(graph, folder)
        assert sorted(inner) == sorted(local), f"{folder}/: the map lists {inner}"
        late = [(m, d) for i, m in enumerate(inner) for d in local[m] if d not in inner[:i]]
        assert not late, f"{folder}/: listed before what they import: {late}"


def test_a_micro_batch_walks_down_the_layers(tmp_path):
    """A training micro-batch's walk through ``compute_loss``, traced: every call from one hfacc module into another.
    It never enters ``setup`` (the checks ran once, before the first window) and never calls into a folder above the
    caller's (that would be a callback from below)."""
    import sys

    from transformers import LlamaConfig, LlamaForCausalLM

    from hfacc import DataCollatorForCausalLM, TokenWeightedArguments, TokenWeightedTrainer
    from tests.helpers import make_examples, run_trainer, train_args

    calls = []  # per traced micro-batch: (caller module, called module), in call order

    class TracedTrainer(TokenWeightedTrainer):
        def compute_loss(self, model, inputs, *args, **kwargs):
            assert self.model_setup is not None  # taken once, in get_batch_samples, before the first window
            moves = []

            def trace(frame, event, arg):
                callee = frame.f_globals.get("__name__", "")
                caller = frame.f_back.f_globals.get("__name__", "") if frame.f_back is not None else ""
                if (
                    event == "call"
                    and callee.startswith("hfacc.")
                    and caller.startswith("hfacc.")
                    and caller != callee
                ):
                    moves.append((caller, callee))

            sys.setprofile(trace)
            try:
                return super().compute_loss(model, inputs, *args, **kwargs)
            finally:
                sys.setprofile(None)
                calls.append(moves)

    torch_model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                              num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2))  # fmt: skip
    args = train_args(tmp_path, 2, 2, args_class=TokenWeightedArguments, max_steps=2)
    run_trainer(TracedTrainer, torch_model, make_examples(8), args, DataCollatorForCausalLM(0))
    rank = {layer: i for i, layer in enumerate(get_layer_order())}
    assert len(calls) == 4 and all(calls)  # 2 steps x 2 micro-batches (the setup ran in get_batch_samples)
    for moves in calls:
        visited = {m for move in moves for m in move}
        assert not [m for m in visited if m.startswith("hfacc.setup.")], visited
        assert {"hfacc.training.trainer", "hfacc.data.padding_free", "hfacc.ops.loss"} <= visited, visited
        up = [(a, b) for a, b in moves if rank[b.split(".")[1]] > rank[a.split(".")[1]]]
        assert not up, f"calls into a folder above the caller's: {up}"
    print("walk:", " -> ".join(dict.fromkeys(m for move in calls[-1] for m in move)), f"({len(calls[-1])} calls)")
