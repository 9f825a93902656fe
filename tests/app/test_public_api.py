"""The application uses the library as any user does: through its public interface alone.

Public, here: the package ``gearsam_fused`` and the modules that docs/api.md documents (each ``.. automodule::`` of
it), and no other module of the library; of the package, the names in its ``__all__`` and those modules; of another
public module, the names in its ``__all__`` where it has one, else the names without a leading underscore that it
defines itself (a function or class it holds must come from a public module, not through it from an internal one).
The application's modules are read with :mod:`ast`: its imports of the library, relative ones included, and the
attributes it reads from a library module it imported.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

import gearsam_fused.app

LIBRARY = "gearsam_fused"
APP = "gearsam_fused.app"
APP_DIR = Path(gearsam_fused.app.__file__).resolve().parent
API_DOC = Path(__file__).resolve().parents[2] / "docs" / "api.md"


def documented_modules() -> set[str]:
    """The package and the modules docs/api.md documents."""
    text = API_DOC.read_text(encoding="utf-8")
    return {LIBRARY, *re.findall(r"^\s*\.\. automodule:: ([\w.]+)", text, flags=re.MULTILINE)}


PUBLIC_MODULES = documented_modules()


def within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def in_library(module: str) -> bool:
    """Whether ``module`` is the library's (the application's own modules are not)."""
    return within(module, LIBRARY) and not within(module, APP)


def public_name(module: str, name: str) -> bool:
    """Whether ``name`` of the public module ``module`` is public (see the module's docstring)."""
    if f"{module}.{name}" in PUBLIC_MODULES:
        return True
    holder = importlib.import_module(module)
    exported = getattr(holder, "__all__", None)
    if exported is not None:
        return name in exported
    if name.startswith("_") or not hasattr(holder, name):
        return False
    home = getattr(getattr(holder, name), "__module__", None)
    return not (isinstance(home, str) and in_library(home)) or home in PUBLIC_MODULES


def violations(source: str, package: str = APP) -> list[str]:
    """What the module ``source`` (of ``package``) takes from the library beyond its public interface, one line each:
    the line number, the import or attribute, and why."""
    found = []
    modules = {}  # local name -> the library module it names
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if not in_library(alias.name):
                    continue
                if alias.name not in PUBLIC_MODULES:
                    found.append(f"line {node.lineno}: import {alias.name}: an internal module")
                local = alias.asname or alias.name.split(".")[0]
                modules[local] = alias.name if alias.asname else local
        elif isinstance(node, ast.ImportFrom):
            parts = package.split(".")
            base = parts[: len(parts) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            for alias in node.names:
                full = f"{module}.{alias.name}"
                if not in_library(module) or not in_library(full):
                    continue
                shown = f"from {'.' * node.level}{node.module or ''} import {alias.name}"
                if module not in PUBLIC_MODULES:
                    found.append(f"line {node.lineno}: {shown}: {module} is an internal module")
                elif not public_name(module, alias.name):
                    found.append(f"line {node.lineno}: {shown}: not a public name of {module}")
                elif full in PUBLIC_MODULES:  # a module: what the application reads from it is checked below
                    modules[alias.asname or alias.name] = full
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules:
            module = modules[node.value.id]
            if module in PUBLIC_MODULES and not public_name(module, node.attr):
                found.append(f"line {node.lineno}: {node.value.id}.{node.attr}: not a public name of {module}")
    return found


def app_modules() -> list[tuple[str, Path]]:
    """``(package, path)`` of every module of the application."""
    found = []
    for path in sorted(APP_DIR.rglob("*.py")):
        folder = path.parent.relative_to(APP_DIR.parent.parent).parts
        found.append((".".join(folder), path))
    return found


@pytest.mark.parametrize("package, path", app_modules(), ids=lambda value: getattr(value, "name", None))
def test_the_application_uses_the_librarys_public_interface_only(package, path):
    found = violations(path.read_text(encoding="utf-8"), package)
    assert not found, f"{path.relative_to(APP_DIR.parent.parent)} reaches past the library's public interface:\n" + (
        "\n".join(found)
    )


def test_the_check_knows_a_public_name_from_an_internal_one():
    """The rule itself, on imports an application might write: each refused one reaches past the interface."""
    refused = [
        "from gearsam_fused.allocation import GEAR_RULE",  # an undocumented module
        "from gearsam_fused.backends import resolve_backend_name",
        "import gearsam_fused.checks",
        "from ..checks import check_real",  # relative, from gearsam_fused/app/
        "from gearsam_fused import checks",  # a module the package does not export
        "from gearsam_fused.optim import check_real",  # a documented module's import from an internal one
        "from gearsam_fused.partition import _LEVELS",  # a private name
        "from gearsam_fused.schedules import Schedule, _internal",  # a module with __all__: only what it lists
        "import gearsam_fused\ngearsam_fused.backends",  # an internal module, read as an attribute
        "from gearsam_fused import timing\ntiming._private",
    ]
    for source in refused:
        assert violations(source), source
    allowed = [
        "from gearsam_fused import SAM, GEARSAM, __version__, available_backends, timing",
        "from gearsam_fused.partition import STRATEGIES, partition as blocks_of",
        "from gearsam_fused.memory import huge_page_setting",
        "from gearsam_fused.analysis import hessian_spectrum",
        "from gearsam_fused.models import MODELS",
        "from .training import RunConfig, _anything_of_the_app",  # the application's own modules
        "from . import plots",
        "import torch\nfrom torch.optim import SGD",
        "from gearsam_fused import timing\ntiming.mark",
    ]
    for source in allowed:
        assert violations(source) == [], source
