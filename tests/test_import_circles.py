"""No two modules of the package import each other, directly or round a longer loop, except for
type-only imports (``scripts/import_cycles.py``; the design's layering rule)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("import_cycles", ROOT / "scripts" / "import_cycles.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_package_has_no_import_circle():
    script = _script()
    graph = script.import_graph(ROOT / "opentinker")
    assert len(graph) > 100  # the whole package was read
    found = script.circles(graph)
    assert not found, "import circles: " + "; ".join(" -> ".join(script.path_through(graph, g)) for g in found)


def test_a_deferred_import_closes_a_circle_and_a_type_only_one_does_not(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("from pkg.sub import thing\n")
    (package / "sub" / "__init__.py").write_text("from .thing import thing\n")
    (package / "sub" / "thing.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.other import Other\n\n"
        "def thing():\n    from .. import version\n    return version\n")
    (package / "version.py").write_text("VERSION = 1\n")
    (package / "other.py").write_text("from pkg.sub.thing import thing\n")
    script = _script()
    assert script.circles(script.import_graph(package)) == []  # the TYPE_CHECKING import is no edge

    (package / "version.py").write_text("def late():\n    from pkg.sub import thing\n    return thing\n")
    graph = script.import_graph(package)
    # ``from pkg.sub import thing`` names the module pkg.sub.thing, so the edge goes there
    assert script.circles(graph) == [["pkg.sub.thing", "pkg.version"]]
    assert script.circles(script.import_graph(package, deferred=False)) == []  # only deferred imports close it
    assert script.path_through(graph, ["pkg.sub.thing", "pkg.version"]) == [
        "pkg.sub.thing", "pkg.version", "pkg.sub.thing"]
