"""The package layout: dependencies point down, no import circle, core imports no upper layer."""

import ast
import pathlib

import sharetree

PACKAGE = pathlib.Path(sharetree.__file__).parent
CORE = {"_errors", "_paths", "_transforms", "_tied", "_resolve"}
UPPER = {"_display", "_io", "flax", "nnx", "__main__", "_demo"}


def _imports(module_file, *, top_level_only):
    tree = ast.parse(module_file.read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    out = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("sharetree"):
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "sharetree" and len(parts) > 1 and (PACKAGE / f"{parts[1]}.py").exists():
                out.add(parts[1])
    return out


def _graph(top_level_only):
    return {
        f.stem: _imports(f, top_level_only=top_level_only) - {f.stem}
        for f in PACKAGE.glob("*.py")
        if f.stem != "__init__"
    }


def test_no_import_circle_among_module_level_imports():
    graph = _graph(top_level_only=True)
    state = {}

    def visit(m, stack):
        state[m] = "open"
        for d in graph.get(m, ()):
            if state.get(d) == "open":
                raise AssertionError("import circle: " + " -> ".join([*stack, m, d]))
            if d not in state:
                visit(d, [*stack, m])
        state[m] = "done"

    for m in graph:
        if m not in state:
            visit(m, [])


def test_core_modules_import_no_upper_layer_anywhere():
    graph = _graph(top_level_only=False)
    for m in CORE:
        bad = graph[m] & UPPER
        # the one allowed exception: Tied's treescope hook renders through the display layer
        if m == "_tied":
            bad -= {"_display"}
        assert not bad, f"{m} imports {sorted(bad)}"


def test_init_is_thin_and_exports_all():
    assert set(sharetree.__all__) <= set(dir(sharetree))
    tree = ast.parse((PACKAGE / "__init__.py").read_text())
    assert all(
        isinstance(n, (ast.ImportFrom, ast.Import, ast.Assign, ast.Expr, ast.AnnAssign))
        for n in tree.body
    )
