"""kha_compile.core.mixins: a mixin class in front of a module's class, made once, findable by pickle."""

from __future__ import annotations

import pickle
import sys

import torch
from torch import nn

from kha_compile.core.mixins import mixin_class


class Marked:
    """A mixin for the tests."""

    def marked(self) -> str:
        return f"marked {type(self).__mro__[2].__name__}"


def test_made_once_with_mro_and_attributes():
    cls = mixin_class(Marked, nn.Linear, "MarkedLinear", __name__, base=nn.Linear)
    assert mixin_class(Marked, nn.Linear, "MarkedLinear", __name__, base=nn.Linear) is cls
    assert cls.__mro__[1:3] == (Marked, nn.Linear) and cls.base is nn.Linear
    assert cls.__module__ == __name__ and cls.__qualname__ == "MarkedLinear"
    assert mixin_class(Marked, nn.Conv1d, "MarkedConv1d", __name__) is not cls


def test_instances_pickle_by_the_module_global():
    cls = mixin_class(Marked, nn.Linear, "MarkedLinear", __name__, base=nn.Linear)
    assert vars(sys.modules[__name__])["MarkedLinear"] is cls
    m = nn.Linear(3, 2)
    m.__class__ = cls
    back = pickle.loads(pickle.dumps(m))
    assert type(back) is cls and back.marked() == "marked Linear"
    assert all((p == q).all() for p, q in zip(m.parameters(), back.parameters(), strict=True))


class ABCFirst(__import__("abc").ABC, nn.Linear):
    """A module class whose primary base is abc.ABC: another object layout chain than nn.Linear's."""


class MixinModule(nn.Module):
    def forward(self, x):
        return 2 * super().forward(x)


def test_a_class_with_an_abc_first_gets_the_mixin_first_over_its_own_layout():
    naive = type("Naive", (MixinModule, ABCFirst), {})
    m = ABCFirst(3, 2)
    try:
        m.__class__ = naive
        raise AssertionError("Python accepted a layout it refuses on this version; the fallback is untested")
    except TypeError:
        pass
    cls = mixin_class(MixinModule, ABCFirst, "MixinABCFirst", __name__)
    m.__class__ = cls
    assert type(m).__mro__[1] is MixinModule and isinstance(m, ABCFirst)
    x = torch.randn(4, 3)
    torch.testing.assert_close(m(x), 2 * nn.functional.linear(x, m.weight, m.bias))
    back = pickle.loads(pickle.dumps(m))
    assert type(back) is cls
    m.__class__ = ABCFirst
    torch.testing.assert_close(m(x), nn.functional.linear(x, m.weight, m.bias))
