"""Internal names are honest: no module of the package uses another module's private name.

A name with a leading underscore belongs to the module that defines it. A helper that
other modules use has a plain name (and is in its module's ``__all__``), or lives in the
one module that uses it. Every module under ``sharetree/`` is parsed; the check counts
``from sharetree.<m> import _x`` and ``<module>._x`` (``<module>`` bound by an import of a
sharetree module), at the top of a module or inside a function body. Private modules
(``from sharetree import _errors``, ``_transforms.spec``) and dunders are fine; so is a
module naming its own private names. The tests may import the private names of the
module they test: only the package is checked.
"""

import ast
import pathlib

import pytest

import sharetree

PACKAGE = pathlib.Path(sharetree.__file__).parent
ROOT = PACKAGE.parent


def _module_name(file):
    """``sharetree/_transforms/spec.py`` -> ``sharetree._transforms.spec`` (a package's init:
    the package)."""
    parts = list(file.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name, root=ROOT):
    """Whether the dotted ``name`` is a module or package on disk under ``root``."""
    path = root.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _private(name):
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _absolute(module, level, here, is_package):
    """The module a ``from`` import names, relative imports resolved against ``here``."""
    if not level:
        return module or ""
    base = here.split(".") if is_package else here.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def cross_module_private_uses(source, here, is_package=False, root=ROOT):
    """``[(line, text)]``: each use in ``source`` (module ``here``) of another sharetree
    module's private name."""
    tree = ast.parse(source)
    modules = {}  # a local name bound to a sharetree module -> that module's dotted name
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "sharetree":
                    # import sharetree._x binds sharetree; import sharetree._x as m binds m
                    modules[a.asname or "sharetree"] = a.name if a.asname else "sharetree"
        elif isinstance(node, ast.ImportFrom):
            source_module = _absolute(node.module, node.level, here, is_package)
            if source_module.split(".")[0] != "sharetree":
                continue
            for a in node.names:
                full = f"{source_module}.{a.name}"
                if _is_module(full, root):
                    modules[a.asname or a.name] = full
                elif _private(a.name) and source_module != here:
                    found.append((node.lineno, f"from {source_module} import {a.name}"))
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and _private(node.attr)):
            continue
        chain, value = [], node.value
        while isinstance(value, ast.Attribute):
            chain.append(value.attr)
            value = value.value
        if not (isinstance(value, ast.Name) and value.id in modules):
            continue
        owner = ".".join([modules[value.id], *reversed(chain)])
        if not _is_module(owner, root) or _is_module(f"{owner}.{node.attr}", root):
            continue  # an attribute of a name in the module, or a private submodule
        if owner != here:
            found.append((node.lineno, f"{owner}.{node.attr} ({ast.unparse(node)})"))
    return found


FILES = sorted(PACKAGE.rglob("*.py"))


def test_the_package_has_modules():
    names = {_module_name(f) for f in FILES}
    assert {"sharetree", "sharetree._resolve", "sharetree._transforms.spec"} <= names


@pytest.mark.parametrize("file", FILES, ids=lambda f: str(f.relative_to(ROOT)))
def test_no_module_uses_another_modules_private_names(file):
    uses = cross_module_private_uses(
        file.read_text(), _module_name(file), file.name == "__init__.py"
    )
    shown = "\n".join(f"  {file.relative_to(ROOT)}:{line}: {text}" for line, text in uses)
    assert not uses, (
        "private names used across modules: give each a plain name in its module (and its "
        f"__all__), or move it to its one user\n{shown}"
    )


@pytest.mark.parametrize(
    ("source", "here", "is_package", "expected"),
    [
        ("from sharetree._resolve import _nodes_at", "sharetree._tie", False, 1),
        ("def f():\n    from sharetree._labels import _glob, exact", "sharetree.nnx", False, 1),
        ("from sharetree._transforms.builtins import _Scale", "sharetree._transforms", True, 1),
        ("from .builtins import _Scale", "sharetree._transforms", True, 1),
        ("from ._resolve import _x", "sharetree._tie", False, 1),
        ("from sharetree import _resolve\n_resolve._nodes_at(1, 2)", "sharetree._tie", False, 1),
        ("import sharetree._resolve as r\nr._CACHE", "sharetree.flax", False, 1),
        ("import sharetree._resolve\nsharetree._resolve._x", "sharetree.flax", False, 1),
        ("from sharetree._transforms import spec\nspec._Reader", "sharetree._load", False, 1),
        ("import sharetree\nsharetree._private_helper", "sharetree.flax", False, 1),
        # fine: private modules, dunders, a module's own names, attributes of objects
        ("from sharetree import _errors, _resolve", "sharetree._tie", False, 0),
        ("from sharetree._transforms import spec, builtins", "sharetree._load", False, 0),
        ("from sharetree._resolve import nodes_at, __doc__", "sharetree._tie", False, 0),
        ("from sharetree._resolve import _x", "sharetree._resolve", False, 0),
        ("from sharetree import _resolve\n_resolve.__name__", "sharetree._tie", False, 0),
        ("from sharetree._resolve import Structure\nStructure._make", "sharetree.x", False, 0),
        ("import os\nos._exit", "sharetree._save", False, 0),
        ("self._cache", "sharetree._flat", False, 0),
    ],
)
def test_the_check_finds_private_uses(source, here, is_package, expected):
    assert len(cross_module_private_uses(source, here, is_package)) == expected, source
