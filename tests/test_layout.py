"""The package layout: each layer imports only the layers above it, anywhere in a module.

The layers are the table of ``docs/architecture.md`` (read from the page: the
layer's name, then its modules in backquotes; a name ending in ``/`` is a
package, whose submodules belong to its layer and may import each other).
Every ``import`` statement counts, at the top of a module or inside a function
body: a hook the display layer provides is registered by it (``_tied.DISPLAY``),
never imported from below. Within a layer, imports may go either way but make
no circle.
"""

import ast
import pathlib
import re

import sharetree

PACKAGE = pathlib.Path(sharetree.__file__).parent
ROOT = pathlib.Path(__file__).resolve().parent.parent
ARCHITECTURE = ROOT / "docs" / "architecture.md"
HEADER = re.compile(r"\|\s*layer\s*\|\s*modules\s*\|")


def read_layers(text):
    """``[(layer, [module, ...]), ...]``, top to bottom, from the page's ``| layer | modules |``."""
    lines = [line.strip() for line in text.splitlines()]
    starts = [i for i, line in enumerate(lines) if HEADER.fullmatch(line)]
    assert len(starts) == 1, f"docs/architecture.md needs one '| layer | modules |' table: {starts}"
    assert re.fullmatch(r"\|\s*-+\s*\|\s*-+\s*\|", lines[starts[0] + 1]), "no |---|---| line"
    layers = []
    for line in lines[starts[0] + 2 :]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert len(cells) == 2, f"a layer row has two cells, layer and modules: {line!r}"
        names = re.findall(r"`([^`]*)`", cells[1])
        assert names and all(re.fullmatch(r"\w+/?", n) for n in names), f"bad row: {line!r}"
        layers.append((cells[0], names))
    return layers


LAYERS = read_layers(ARCHITECTURE.read_text())
INNER = re.compile(r"\|\s*files module\s*\|\s*job\s*\|")


def read_inner_order(text):
    """The modules of ``_files``, top to bottom, from the page's ``| files module | job |``."""
    lines = [line.strip() for line in text.splitlines()]
    starts = [i for i, line in enumerate(lines) if INNER.fullmatch(line)]
    assert len(starts) == 1, (
        f"docs/architecture.md needs one '| files module | job |' table: {starts}"
    )
    order = []
    for line in lines[starts[0] + 2 :]:
        if not line.startswith("|"):
            break
        name = re.fullmatch(r"\|\s*`(\w+)`\s*\|.+\|", line)
        assert name, f"a row of the files table names one module, then its job: {line!r}"
        order.append(name.group(1))
    return order


FILES_ORDER = read_inner_order(ARCHITECTURE.read_text())
PLANNED = {n.rstrip("/"): n.endswith("/") for _, names in LAYERS for n in names}  # -> a package?
LAYER = {n.rstrip("/"): i for i, (_, names) in enumerate(LAYERS) for n in names}

LAZY_THIRD_PARTY = {
    "treescope",  # optional (notebook extra): only the display renders with it
    "optax",  # optional (demo extra): only the demo trains
    "tqdm",  # optional (demo extra): the demo's progress bar
    "safetensors",  # read and written only where a file is
    "jax.experimental",  # multihost_utils, for save(gather=True) only
}
"""The only third-party modules imported inside function bodies."""


def _modules():
    """Module name -> file: ``_flat``, a package's ``_transforms`` and ``_transforms.spec``."""
    files = {}
    for f in sorted(PACKAGE.glob("*.py")):
        files[f.stem] = f
    for init in sorted(PACKAGE.glob("*/__init__.py")):
        files[init.parent.name] = init
        for f in sorted(init.parent.glob("*.py")):
            if f.name != "__init__.py":
                files[f"{init.parent.name}.{f.stem}"] = f
    return files


FILES = _modules()
PRESENT = {m: FILES[m].parent != PACKAGE for m in FILES if "." not in m}  # -> a package?


def _layer(module):
    """The layer index of a module or submodule, ``None`` if the table does not name it."""
    return LAYER.get(module.split(".")[0])


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
            assert node.module is not None
            names = [node.module]
            if node.module.split(".")[0] == "sharetree":  # from sharetree import _demo / save
                names = [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            yield name, id(node) in lazy, node.lineno


def _own(name):
    """The sharetree module that importing ``name`` names (``__init__`` for its names), or None.

    The longest dotted prefix that is a module: ``sharetree._transforms.spec.x`` names
    ``_transforms.spec``, ``sharetree._flat.destructure`` names ``_flat``.
    """
    parts = name.split(".")
    if parts[0] != "sharetree":
        return None
    for n in range(len(parts), 1, -1):
        if (module := ".".join(parts[1:n])) in FILES:
            return module
    return "__init__"


def test_the_table_is_read_from_the_architecture_page():
    names = [layer for layer, _ in LAYERS]
    assert names[0] == "base" and names[-1] == "face" and len(set(names)) == len(names) >= 5
    listed = [n for _, modules in LAYERS for n in modules]
    assert len(listed) == len(set(listed)), "a module is listed in two rows"
    assert {"_errors", "_tied", "_resolve", "__init__"} <= set(PLANNED)


def test_every_module_has_a_layer():
    missing = sorted(set(PLANNED) - set(PRESENT))
    unplanned = sorted(set(PRESENT) - set(PLANNED))
    kind = sorted(
        f"{m} is {'a package' if PRESENT[m] else 'a module'}, the table says "
        f"{'a package' if PLANNED[m] else 'a module'}"
        for m in set(PLANNED) & set(PRESENT)
        if PLANNED[m] != PRESENT[m]
    )
    problems = (
        [f"planned in docs/architecture.md, missing from sharetree/: {missing}"] * bool(missing)
        + [f"in sharetree/ but in no row of docs/architecture.md: {unplanned}"] * bool(unplanned)
        + kind
    )
    assert not problems, "\n".join(problems)


def test_each_layer_has_its_paragraph_naming_its_modules():
    text = ARCHITECTURE.read_text()
    paragraphs = {p.split("**")[1]: p for p in text.split("\n\n") if p.startswith("**")}
    for layer, modules in LAYERS:
        assert layer in paragraphs, f"docs/architecture.md: no paragraph starting **{layer}**"
        for m in modules:
            name = re.escape(m.rstrip("/"))
            found = re.search(rf"`(sharetree\.)?{name}`", paragraphs[layer])
            assert found, f"docs/architecture.md: the **{layer}** paragraph does not name `{m}`"


def test_imports_point_down_anywhere_in_a_module():
    bad = []
    for m, path in FILES.items():
        if _layer(m) is None:
            continue  # test_every_module_has_a_layer names it
        for name, lazy, line in _imports(path):
            own = _own(name)
            where = f"{path.relative_to(PACKAGE)}:{line}"
            if own is None:
                allowed = any(name == p or name.startswith(p + ".") for p in LAZY_THIRD_PARTY)
                if lazy and not allowed:
                    bad.append(f"{where} imports {name} inside a function")
            elif _layer(own) is None:
                bad.append(f"{where} imports {own}, which no row of docs/architecture.md names")
            elif _layer(own) > _layer(m):
                bad.append(
                    f"{where} ({LAYERS[_layer(m)][0]}) imports {own} "
                    f"({LAYERS[_layer(own)][0]}, a lower layer)"
                )
    assert not bad, "\n".join(bad)


def test_no_import_circle():
    graph = {m: {_own(n) for n, _, _ in _imports(f)} - {None, m} for m, f in FILES.items()}
    graph["__init__"] = set()  # every submodule import runs the package first, by design
    state = {}

    def visit(m, stack):
        state[m] = "open"
        for d in sorted(graph.get(m, ())):
            if state.get(d) == "open":
                raise AssertionError("import circle: " + " -> ".join([*stack, m, d]))
            if d not in state:
                visit(d, [*stack, m])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [])


def test_the_files_package_imports_only_modules_above_it_in_its_table():
    present = sorted(f.stem for f in (PACKAGE / "_files").glob("*.py") if f.stem != "__init__")
    assert sorted(FILES_ORDER) == present, "docs/architecture.md's files table and sharetree/_files"
    assert len(FILES_ORDER) == len(set(FILES_ORDER)), "a module is listed twice in the files table"
    rank = {m: i for i, m in enumerate(FILES_ORDER)}
    bad = []
    for m in FILES_ORDER:
        path = FILES[f"_files.{m}"]
        for name, _, line in _imports(path):
            own = _own(name)
            if own is not None and own.startswith("_files.") and own != f"_files.{m}":
                other = own.split(".")[1]
                if rank[other] > rank[m]:
                    bad.append(f"_files/{m}.py:{line} imports {other}, below it in the files table")
            if own == "_files":
                bad.append(f"_files/{m}.py:{line} imports the package _files itself")
    assert not bad, "\n".join(bad)


def test_the_readme_points_to_the_architecture_page_and_keeps_no_table_of_its_own():
    readme = (ROOT / "README.md").read_text()
    assert "(docs/architecture.md)" in readme, "README.md: link the layers to docs/architecture.md"
    tables = [line for line in readme.splitlines() if HEADER.fullmatch(line.strip())]
    assert not tables, "README.md has a layer table: the layers are docs/architecture.md's"


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
