"""fmoe.ops.backend: the dispatch rule, and the check of the installed Triton interpreter."""

import pytest
import torch

from fmoe.ops import backend
from fmoe.ops.backend import interpreter_problem, use_triton


def test_dispatch_rule():
    x = torch.zeros(2)
    assert use_triton("torch", x) is False and use_triton("auto", x) is False  # CPU tensors: the reference
    with pytest.raises(ValueError, match="impl: expected one of"):
        use_triton("cuda", x)


@pytest.mark.parametrize("triton_version, numpy_version, refused", [
    ("3.6.0", "2.4.6", True),       # torch 2.11's Triton with the newest numpy
    ("3.5.1+git9a1b", "2.4.0rc1", True),
    ("3.6.0", "2.3.5", False),      # numpy before 2.4: the interpreter runs the kernels
    ("3.7.1", "2.4.6", False),      # the CPU pin
    ("3.10.0", "2.10.0", False),    # compared as numbers, not as text
])
def test_interpreter_problem_names_the_versions_and_the_fix(triton_version, numpy_version, refused):
    problem = interpreter_problem(triton_version, numpy_version)
    assert (problem is not None) == refused
    if refused:
        assert f"Triton {triton_version}" in problem and f"numpy {numpy_version}" in problem
        assert "install numpy<2.4, or Triton 3.7 or newer" in problem and "impl='torch'" in problem


def test_interpreted_kernels_refuse_an_interpreter_that_cannot_run_them(monkeypatch):
    """impl='triton' on CPU under TRITON_INTERPRET=1 stops with the reason, instead of an
    InterpreterError from inside the first kernel; the reference still runs."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(backend, "INTERPRETER_PROBLEM", "impl='triton' on CPU: the interpreter of Triton 3.6.0 cannot ...")
    x = torch.zeros(2)
    with pytest.raises(RuntimeError, match="the interpreter of Triton 3.6.0 cannot"):
        use_triton("triton", x)
    assert use_triton("torch", x) is False and use_triton("auto", x) is False
    monkeypatch.setattr(backend, "INTERPRETER_PROBLEM", None)
    assert use_triton("triton", x) is True


def test_the_installed_versions_are_checked_once_at_import():
    assert backend.INTERPRETER_PROBLEM == interpreter_problem()
