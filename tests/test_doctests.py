"""Every docstring example in the package runs and prints what it shows (doctest): the
examples are what a user copies first, and nothing else would notice one going stale."""

import doctest
import importlib
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
MODULES = sorted(".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
                 for p in (ROOT / "fmoe").rglob("*.py") if ">>>" in p.read_text())


def test_the_package_has_examples_to_run():
    assert len(MODULES) >= 10, MODULES


@pytest.mark.parametrize("name", MODULES)
def test_a_module_s_docstring_examples_print_what_they_show(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0, result
