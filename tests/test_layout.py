"""The package layout: each layer imports only the layers above it, anywhere in a module.

Every ``import`` statement counts, at the top of a module or inside a function
body: a hook the display layer provides is registered by it (``_tied.DISPLAY``),
never imported from below. Within a layer, imports may go either way but make
no circle.
"""

import ast
import pathlib

import sharetree

PACKAGE = pathlib.Path(sharetree.__file__).parent

LAYERS = [  # as in DESIGN.md, "Layout": top to bottom
    ("base", {"_errors", "_paths"}),
    ("core", {"_transforms", "_tied", "_resolve"}),
    (
        "operations",
        {"_materialize", "_flat", "_report", "_tie", "_detect", "_labels", "_sharding"}
        | {"_untie", "_grad_by_use"},
    ),
    ("files", {"_format", "_safetensors", "_io", "_foreign"}),
    ("display", {"_tables", "_display", "_grad_report"}),
    ("integrations", {"flax", "nnx"}),
    ("face", {"__init__", "__main__", "_demo", "_lm"}),
]
LAYER = {m: i for i, (_, modules) in enumerate(LAYERS) for m in modules}

LAZY_THIRD_PARTY = {
    "treescope",  # optional (notebook extra): only the display renders with it
    "optax",  # optional (demo extra): only the demo trains
    "tqdm",  # optional (demo extra): the demo's progress bar
    "safetensors",  # read and written only where a file is
    "jax.experimental",  # multihost_utils, for save(gather=True) only
}
"""The only modules imported inside function bodies: none of sharetree's own."""


def _imports(module_file):
    """``(module imported, whether inside a function body, line)`` for every import statement."""
    tree = ast.parse(module_file.read_text())
    lazy = {
        id(n)
        for f in ast.walk(tree)
        if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for n in ast.walk(f)
    }
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{module_file.name}:{node.lineno}: relative import"
            names = [node.module]
            if node.module == "sharetree":  # from sharetree import _demo / save
                names = [f"sharetree.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            yield name, id(node) in lazy, node.lineno


def _own(name):
    """The sharetree module that importing ``name`` names (``__init__`` for its names), or None."""
    parts = name.split(".")
    if parts[0] != "sharetree":
        return None
    if len(parts) > 1 and (PACKAGE / f"{parts[1]}.py").exists():
        return parts[1]
    return "__init__"


MODULES = sorted(f.stem for f in PACKAGE.glob("*.py"))


def test_every_module_has_a_layer():
    assert set(MODULES) == set(LAYER), set(MODULES) ^ set(LAYER)


def test_imports_point_down_anywhere_in_a_module():
    bad = []
    for m in MODULES:
        for name, lazy, line in _imports(PACKAGE / f"{m}.py"):
            own = _own(name)
            if own is None:
                allowed = any(name == p or name.startswith(p + ".") for p in LAZY_THIRD_PARTY)
                if lazy and not allowed:
                    bad.append(f"{m}.py:{line} imports {name} inside a function")
            elif own != m and LAYER[own] > LAYER[m]:
                bad.append(
                    f"{m}.py:{line} ({LAYERS[LAYER[m]][0]}) imports {own} "
                    f"({LAYERS[LAYER[own]][0]}, a lower layer)"
                )
    assert not bad, "\n".join(bad)


def test_no_import_circle():
    graph = {m: {_own(n) for n, _, _ in _imports(PACKAGE / f"{m}.py")} - {None, m} for m in MODULES}
    graph["__init__"] = set()  # every submodule import runs the package first, by design
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


def test_the_display_hooks_are_registered_in_a_fresh_process():
    import subprocess
    import sys

    code = (
        "import numpy as np, sharetree as st, treescope\n"
        "tree = {'a': np.zeros((2, 3)), 'b': st.Tied('a', st.T)}\n"
        "g = st.canonicalize(tree)\n"
        "print('<svg' in g._repr_html_(), 'b0 -> v0' in g.to_dot(),\n"
        "      'view of a via T' in treescope.render_to_text(tree))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "True", "True"]


def test_init_is_thin_and_exports_all():
    assert set(sharetree.__all__) <= set(dir(sharetree))
    tree = ast.parse((PACKAGE / "__init__.py").read_text())
    assert all(
        isinstance(n, (ast.ImportFrom, ast.Import, ast.Assign, ast.Expr, ast.AnnAssign))
        for n in tree.body
    )
