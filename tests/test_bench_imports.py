"""Every bench/ script's top-level ``from M import names`` finds those names, so a renamed helper
module cannot leave a script broken until someone next runs it (bench/kernels.py became
kernel_bench.py, and two scripts imported Hugging Face's ``kernels`` package in its place)."""
from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
SCRIPTS = sorted(BENCH.glob("*.py"))


def top_level_from_imports(path: Path) -> list[tuple[str, list[str]]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    return [(node.module, [a.name for a in node.names]) for node in tree.body
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module != "__future__"]


@pytest.mark.parametrize("script", SCRIPTS, ids=[p.name for p in SCRIPTS])
def test_bench_scripts_import_names_that_exist(script, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    for module, names in top_level_from_imports(script):
        mod = importlib.import_module(module)
        missing = [n for n in names if n != "*" and not hasattr(mod, n)]
        assert not missing, f"{script.name}: {module} ({getattr(mod, '__file__', None)}) has no {missing}"


def test_the_bench_scripts_are_found():
    assert len(SCRIPTS) > 30, SCRIPTS


def test_every_kernel_knockout_still_applies_to_the_kernel_source(monkeypatch):
    """bench/kernel_knockout.py replaces lines of the attention kernel's source: each knock-out's lines
    must still be there (once), or the script would time a copy that knocks out nothing."""
    monkeypatch.syspath_prepend(str(BENCH))
    knockout = importlib.import_module("kernel_knockout")
    source = knockout.SOURCE.read_text()
    for name in knockout.KNOCKOUTS:
        assert knockout.knocked_out(name) != source, name
