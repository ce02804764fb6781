"""kha_compile.core.errors: one sorted __all__ of KHAError subclasses, and specific classes where raised."""

from __future__ import annotations

import inspect

import pytest
from torch import nn

import kha_compile as kc
from kha_compile.core import errors


def test_all_lists_exactly_the_error_classes_sorted():
    classes = {n for n, c in vars(errors).items() if inspect.isclass(c) and issubclass(c, errors.KHAError)}
    assert set(errors.__all__) == classes
    assert errors.__all__ == sorted(errors.__all__)


@pytest.mark.parametrize("name", errors.__all__)
def test_every_class_has_a_one_line_docstring(name):
    doc = getattr(errors, name).__doc__
    assert doc and "\n" not in doc.strip() and doc.strip().endswith(".")


def test_input_errors_are_also_the_builtin_kind():
    assert issubclass(errors.KHAConfigError, ValueError) and issubclass(errors.UnknownTransformError, ValueError)
    assert issubclass(errors.MissingDependencyError, ImportError) and issubclass(errors.InternalError, RuntimeError)


def test_mark_trainable_without_kha_says_to_apply_first():
    with pytest.raises(errors.NoKHATransformsError, match=r"carries no KHA parameters; call kc\.apply"):
        kc.mark_trainable(nn.Linear(4, 4))
