"""The inputs each module had in a trace (analysis/call_inputs.py), kept as shapes and made afresh."""

from __future__ import annotations

import torch
from torch import nn

from kha_compile.analysis.call_inputs import TensorSpec, materialize, recording


class _Inner(nn.Module):
    def forward(self, x, mask=None, scale=1.0, extra=None):
        return x * scale if mask is None else x.masked_fill(mask, 0.0) * scale


class _Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = _Inner(), _Inner()

    def forward(self, x):
        y = self.a(x, mask=x > 0, scale=2.0)
        y = self.a(y[:, :3])  # a second call: the first is kept
        return self.b(y, extra=object())  # an object of the model's: that call is not recorded


def test_the_first_call_of_each_module_is_kept_as_shapes_in_an_export():
    model = _Outer()
    x = torch.randn(2, 5, 4)
    with recording(model) as seen:
        torch.export.export(model, (x,), strict=False)
    args, kwargs = seen[id(model.a)]
    assert args == (TensorSpec((2, 5, 4), torch.float32, torch.device("cpu")),)
    assert kwargs == {"mask": TensorSpec((2, 5, 4), torch.bool, torch.device("cpu")), "scale": 2.0}
    assert seen[id(model.b)] is None
    assert not model.a._forward_pre_hooks  # the hooks are gone
    made_args, made_kwargs = materialize((args, kwargs))
    assert made_args[0].shape == (2, 5, 4) and made_kwargs["mask"].dtype == torch.bool
    assert not any(isinstance(t, torch._subclasses.FakeTensor) for t in (*made_args, made_kwargs["mask"]))


def test_meta_inputs_stay_on_meta():
    with torch.device("meta"):
        model = _Outer()
        x = torch.empty(2, 5, 4)
    with recording(model) as seen:
        model(x)
    (arg,), _ = materialize(seen[id(model.a)])
    assert arg.is_meta and arg.shape == (2, 5, 4)
