"""The floors of the package and the pass registry: dependencies point one way, never up.

profiler (TF at the edge, the IR) <- models; remat and baechi each build on profiler and models
and never on each other; pipeline (the orchestration) on all four; tools and bench on
everything. A module that reaches up a floor fails here, not in a review.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ALLOWED = {
    "models": {"models"},
    "profiler": {"profiler", "models"},
    "remat": {"remat", "profiler", "models"},
    "baechi": {"baechi", "profiler", "models"},
    "pipeline": {"pipeline", "remat", "baechi", "profiler", "models"},
}


def _imported_floors(path: Path) -> set[str]:
    floors = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = ([alias.name for alias in node.names] if isinstance(node, ast.Import) else
                 [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
        floors |= {name.split(".")[1] for name in names
                   if name.startswith("graphfit.") and name.count(".") >= 1}
    return floors


@pytest.mark.parametrize("floor", sorted(ALLOWED))
def test_a_floor_imports_only_the_floors_below_it(floor):
    for path in sorted((ROOT / floor).glob("*.py")):
        upward = _imported_floors(path) - ALLOWED[floor] - {"errors"}    # the root's errors
        assert not upward, f"{path.relative_to(ROOT)} imports {sorted(upward)}"


def test_every_graph_pass_is_registered_once_and_loads():
    from graphfit.pipeline.passes import GRAPH_PASSES, PASSES

    names = [p.name for p in GRAPH_PASSES]
    assert len(set(names)) == len(names) and PASSES == (*names, "remat", "place")
    for graph_pass in GRAPH_PASSES:
        assert callable(graph_pass.load())
