"""kha_compile.backend.projection: the fold the graph rewrites compute at run time."""

from __future__ import annotations

import pytest
import torch

from kha_compile.backend.projection import fold_fn
from kha_compile.model.slots import HeadSlot


@pytest.mark.parametrize("axis", [0, 1], ids=["linear_out_in", "conv1d_in_out"])
@pytest.mark.parametrize("with_bias", [True, False])
def test_fold_fn_matches_the_transform_applied_after_the_projection(axis, with_bias):
    """x W^T (+ b), then x @ T on the heads of two interleaved slots == x with the folded weight."""
    g = torch.Generator().manual_seed(0)
    heads, dh, d_in = 3, 4, 5
    width = heads * 2 * dh  # [H, 2, Dh]: q and v interleaved
    slots = [HeadSlot("q", 0, heads, dh, 2 * dh), HeadSlot("v", dh, heads, dh, 2 * dh)]
    ts = [torch.randn(dh, dh, generator=g, dtype=torch.float64) for _ in slots]
    w = torch.randn(width, d_in, generator=g, dtype=torch.float64)  # (out, in)
    b = torch.randn(width, generator=g, dtype=torch.float64) if with_bias else None
    x = torch.randn(7, d_in, generator=g, dtype=torch.float64)
    y = x @ w.T + (b if b is not None else 0)  # (N, out)
    want = y.clone()
    for s, t in zip(slots, ts):
        idx = s.index()  # (H, Dh)
        want[:, idx] = y[:, idx] @ t  # (N, H, Dh) @ (Dh, Dh)
    stored = w if axis == 0 else w.T.contiguous()
    out = fold_fn(slots, axis)(stored, b, *ts)
    assert len(out) == (2 if with_bias else 1)
    w2 = out[0] if axis == 0 else out[0].T
    got = x @ w2.T + (out[1] if with_bias else 0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # fold_rows accumulates in float32
    assert out[0].dtype == torch.float64 and out[0].is_contiguous()
