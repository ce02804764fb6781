"""Per-submodule tracing: inputs recorded from one forward, caches snapshotted, paths made the model's."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import forms_zoo as fz
import kha_compile as kc
from kha_compile.analysis.submodules import record_calls, trace_and_match
from kha_compile.core.errors import TraceError


class Cache:
    def __init__(self):
        self.seen = []


class Filling(nn.Module):
    """A layer that appends to a cache object it is given (as transformers' caches do)."""

    def __init__(self):
        super().__init__()
        self.attn = fz.SelfAttn()

    def forward(self, x, cache):
        cache.seen.append(x.shape[1])
        return self.attn(x)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Filling(), Filling()])

    def forward(self, x):
        cache = Cache()
        for layer in self.layers:
            x = layer(x, cache)
        if x.sum() > 0:  # data-dependent: torch.export refuses it
            x = -x
        return x


x = torch.randn(2, 10, fz.D, generator=torch.Generator().manual_seed(0))


def test_recorded_inputs_are_copies_taken_at_the_call():
    model = Model()
    calls = record_calls(model, (x,), {})
    (a, _), (b, _) = calls[id(model.layers[0])], calls[id(model.layers[1])]
    assert torch.equal(a[0], x) and a[0] is not x
    assert a[1].seen == [] and b[1].seen == [10]  # each as it was when the layer was called


def test_a_model_that_does_not_trace_whole_is_matched_per_submodule_with_real_paths():
    cap, raw = trace_and_match(Model(), (x,), {})
    assert cap.exported is None and cap.path.startswith("per submodule (the whole-model trace failed")
    assert [r.name for r in raw] == ["layers.0.attn"]  # one block per type, for both copies
    assert raw[0].roles["q"].projection.module_path == "layers.0.attn.q"
    assert cap.expand_path("layers.0.attn") == ["layers.0.attn", "layers.1.attn"]


def test_apply_per_submodule_puts_kha_into_every_copy():
    model = Model()
    kc.apply(model, kc.KHAConfig(v="linear"), example_args=(x,))
    assert {n for n, _ in model.named_parameters() if ".kha." in n} == {
        "layers.0.attn.v.kha.v.weight",
        "layers.1.attn.v.kha.v.weight",
    }


class Encoder(nn.Module):
    """A traceable submodule holding three alike blocks (a ModuleList the part's trace cuts to one)."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([fz.SelfAttn() for _ in range(3)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = Encoder()

    def forward(self, x):
        y = self.encoder(x)
        return -y if y.sum() > 0 else y  # data-dependent: the model is traced per submodule


def test_repeated_blocks_inside_a_traced_submodule_all_get_kha():
    """The part ``encoder`` is traced with its list cut to one block; every copy must still get KHA."""
    model = Outer()
    kc.apply(model, kc.KHAConfig(v="linear"), example_args=(x,))
    report = kc.inspect(model, example_args=(x,))
    assert report.trace_path.startswith("per submodule")
    assert [s.name for s in report.matched] == [f"encoder.layers.{i}" for i in range(3)]
    assert {n for n, _ in model.named_parameters() if ".kha." in n} == {
        f"encoder.layers.{i}.v.kha.v.weight" for i in range(3)
    }


def test_when_the_model_itself_fails_the_whole_model_reason_is_raised():
    class Broken(fz.SelfAttn):
        def forward(self, x):
            raise ValueError("wrong inputs")

    with pytest.raises(TraceError, match="ValueError: wrong inputs"):
        kc.apply(Broken(), kc.KHAConfig(v="linear"), example_args=(x,))
