"""Attention forms of issue 22 (heads as modules, KV caches written in place, sparse selection):
every site matched, identity at init, the perturbed output equal to an independent per-head
reference with one shared T per role (``tests/forms_zoo_more.py``), and linear KHA folded exactly."""

from __future__ import annotations

import re

import pytest
import torch

import forms_zoo_more as fm
import kha_compile as kc
from form_checks import check_form
from helpers import kha_params, perturb
from kha_compile.core.errors import NoAttentionFoundError

B, S, D = 2, 40, fm.D


def _x(seed: int = 0, shape: tuple[int, ...] = (B, S, D)) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _edges(n: int = 30, e: int = 90) -> torch.Tensor:
    return torch.randint(0, n, (2, e), generator=torch.Generator().manual_seed(5))


# name -> (model class, inputs, sites)
FORMS = {
    "heads_as_modules_concatenated": (fm.HeadModulesNet, lambda: (_x(),), 2),
    "heads_as_modules_averaged": (fm.MeanHeadsNet, lambda: (_x(),), 2),
    "heads_as_modules_shared_value": (fm.SharedValueNet, lambda: (_x(),), 2),
    "sparse_top_queries": (fm.TopQueries, lambda: (_x(),), 1),
    "sparse_sampled_keys": (fm.SampledKeys, lambda: (_x(),), 1),
    "fused_qkv_rows_permuted_per_group": (fm.GroupedWqkvNet, lambda: (_x(),), 2),
    "routed_heads_mixture_of_attention": (fm.RoutedHeads, lambda: (_x(),), 1),
    "graph_attention_segment_softmax": (fm.GraphAttnNet, lambda: (_x(0, (30, D)), _edges()), 2),
}


@pytest.mark.parametrize("v", ["linear", "mlp"])
@pytest.mark.parametrize("form", sorted(FORMS))
def test_form_matches_a_per_head_reference(form, v):
    cls, inputs, sites = FORMS[form]
    args = inputs()
    check_form(cls, args, v, sites=sites, qk=True, reference=lambda m: m.reference(*args))


def test_heads_as_modules_are_one_site_with_one_transform_per_role():
    model = fm.SharedValueNet()
    kc.apply(model, kc.KHAConfig(q="linear", k="linear", v="mlp"), example_args=(_x(),))
    site = kc.inspect(model, example_args=(_x(),)).matched[0]
    assert (site.name, site.num_heads, site.num_kv_heads, site.join) == ("blocks.0", 4, 4, {"q": "heads", "k": "heads"})
    assert site.joint == {"q": [f"blocks.0.qs.{h}" for h in (1, 2, 3)], "k": [f"blocks.0.ks.{h}" for h in (1, 2, 3)]}
    assert "heads written as separate modules" in site.note
    owners = sorted({n.partition(".kha.")[0] for n in kha_params(model) if n.startswith("blocks.0.")})
    assert owners == ["blocks.0.ks.0", "blocks.0.qs.0", "blocks.0.v"]  # one T per role, the shared v its own
    assert model.blocks[0].qs[3].kha["q"] is model.blocks[0].qs[0].kha["q"]


def test_heads_as_modules_with_channels_first_convolutions_are_skipped_naming_the_form():
    """EfficientViT-MSRA's cascaded heads: one 1x1 conv per head over (B, C, H, W) (features on axis 1),
    each head's input adding the previous head's output. One transform would have to be shared by
    convolutions only the functional handler carries: skipped, saying so, and the model untouched."""

    class Cascaded(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkvs = torch.nn.ModuleList(torch.nn.Conv2d(D // fm.H, 3 * fm.DH, 1) for _ in range(fm.H))

        def forward(self, x):
            b, _, h, w = x.shape
            feat, outs = None, []
            for i, (chunk, qkv) in enumerate(zip(x.chunk(fm.H, dim=1), self.qkvs)):
                feat = chunk if i == 0 else feat + chunk
                q, k, v = qkv(feat).flatten(2).split(fm.DH, dim=1)  # (B, Dh, N)
                attn = (q.transpose(-2, -1) @ k).softmax(-1)
                feat = (v @ attn.transpose(-2, -1)).view(b, fm.DH, h, w)
                outs.append(feat)
            return torch.cat(outs, 1)

    model, x = Cascaded(), _x(0, (B, D, 4, 4))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    heads = re.escape("heads written as separate modules (qkvs.0, qkvs.1, qkvs.2, qkvs.3)")
    with pytest.raises(NoAttentionFoundError, match=heads) as info:
        kc.apply(model, kc.KHAConfig(v="mlp"), example_args=(x,))
    assert "functional handler" in str(info.value) and "features on the last axis" in str(info.value)
    assert model.state_dict().keys() == before.keys() and all(
        torch.equal(before[k], v) for k, v in model.state_dict().items()
    )


def test_a_residual_add_of_two_single_head_attentions_is_not_one_attention():
    """Two single-head blocks in a row: each output is added to the residual stream, not combined."""

    class One(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.head, self.o = fm.Head(), torch.nn.Linear(fm.DH, D)

        def forward(self, x):
            return x + self.o(self.head(x))

    model = torch.nn.Sequential(One(), One())
    report = kc.inspect(model, example_args=(_x(),))
    assert [(s.name, s.num_heads) for s in report.matched] == [("0.head", 1), ("1.head", 1)]


# ---- KV caches written in place: prefill, then decode steps ------------------------------------

N_PREFILL, N_DECODE = 6, 3


def _run_meta(model, x_all):
    outs = [model(x_all[:, :N_PREFILL], 0)]
    for i in range(N_PREFILL, N_PREFILL + N_DECODE):
        outs.append(model(x_all[:, i : i + 1], i))
    return torch.cat(outs, dim=1)


def _run_fast(model, x_all, cache=None):
    def call(x, pos):
        mask = torch.ones(len(pos), fm.MAX_LEN, dtype=torch.bool).tril(int(pos[0]))  # (S, max_len)
        return model(x, pos, mask) if cache is None else model(x, pos, mask, cache)

    outs = [call(x_all[:, :N_PREFILL], torch.arange(N_PREFILL))]
    for i in range(N_PREFILL, N_PREFILL + N_DECODE):
        outs.append(call(x_all[:, i : i + 1], torch.tensor([i])))
    return torch.cat(outs, dim=1)


def _list_cache():
    return [torch.zeros(2, fm.H, fm.MAX_LEN, fm.DH), torch.zeros(2, fm.H, fm.MAX_LEN, fm.DH)]


CACHES = {
    "slice_assignment_buffers": (fm.MetaCacheAttn, _run_meta, fm.meta_reference, lambda x: (x[:, :N_PREFILL], 0)),
    "index_put_buffers": (
        lambda: fm.FastCacheAttn("index_put"),
        _run_fast,
        fm.fast_reference,
        lambda x: (x[:, :N_PREFILL], torch.arange(N_PREFILL), torch.ones(N_PREFILL, fm.MAX_LEN, dtype=torch.bool)),
    ),
    "index_copy_buffers": (
        lambda: fm.FastCacheAttn("index_copy"),
        _run_fast,
        fm.fast_reference,
        lambda x: (x[:, :N_PREFILL], torch.arange(N_PREFILL), torch.ones(N_PREFILL, fm.MAX_LEN, dtype=torch.bool)),
    ),
    "list_argument": (
        fm.ListCacheAttn,
        lambda m, x: _run_fast(m, x, _list_cache()),
        fm.fast_reference,
        lambda x: (
            x[:, :N_PREFILL],
            torch.arange(N_PREFILL),
            torch.ones(N_PREFILL, fm.MAX_LEN, dtype=torch.bool),
            _list_cache(),
        ),
    ),
}


@pytest.mark.parametrize("v", ["linear", "mlp"])
@pytest.mark.parametrize("form", sorted(CACHES))
def test_kv_cache_written_in_place_prefill_and_decode_match_a_per_head_reference(form, v):
    make, run, reference, example = CACHES[form]
    torch.manual_seed(0)
    model = make().eval()
    x_all = _x(1, (B, N_PREFILL + N_DECODE, D))
    with torch.no_grad():
        before = run(model, x_all)
        torch.testing.assert_close(before, reference(model, x_all), rtol=1e-4, atol=1e-5)  # the reference is right
    kc.apply(model, kc.KHAConfig(q="linear", k="linear", v=v), example_args=example(x_all))
    site = kc.inspect(model, example_args=example(x_all)).matched[0]
    assert (site.num_heads, site.num_kv_heads) == (fm.H, fm.H)
    with torch.no_grad():
        assert torch.equal(run(model, x_all), before)
        perturb(model)
        moved = run(model, x_all)
        assert (moved - before).abs().max() > 1e-3
        torch.testing.assert_close(moved, reference(model, x_all), rtol=1e-4, atol=1e-5)
        if v == "linear":
            kc.fold(model)
            assert not kha_params(model)
            torch.testing.assert_close(run(model, x_all), moved, rtol=1e-5, atol=1e-5)


def test_a_cache_nothing_writes_is_named_in_the_reason():
    class ReadOnly(fm.MetaCacheAttn):
        def forward(self, x, start_pos):
            b, s, _ = x.shape
            q = self.wq(x).view(b, s, fm.H, fm.DH).transpose(1, 2)
            k, v = self.cache_k[:b].transpose(1, 2), self.cache_v[:b].transpose(1, 2)  # filled elsewhere
            return torch.nn.functional.scaled_dot_product_attention(q, k, v)

    (site,) = kc.inspect(ReadOnly(), example_args=(_x(), 0)).sites
    assert "it reads the buffer cache_k (a KV cache?), which nothing in the traced forward writes" in site.reason


def test_indexing_the_head_axis_with_a_computed_index_is_refused_with_the_reason():
    with pytest.raises(NoAttentionFoundError, match=r"index_select along axis 1, which holds heads or features"):
        kc.apply(fm.HeadPicked(), kc.KHAConfig(v="linear"), example_args=(_x(),))


def test_a_fused_qkv_whose_query_rows_are_a_permutation_takes_an_index_map_and_saves_it(tmp_path):
    model = fm.GroupedWqkvNet()
    x = _x()
    kc.apply(model, kc.KHAConfig(q="linear", k="linear", v="mlp"), example_args=(x,))
    site = kc.inspect(model, example_args=(x,)).matched[0]
    assert (site.kind, site.num_heads, site.num_kv_heads) == ("gqa", fm.H, fm.KV)
    slots = {s.role: s for s in model.blocks[0].wqkv._kha_slots}
    assert slots["q"].rows is not None and slots["k"].rows is None  # q: an index map; k: affine
    per_group = (fm.REP + 2) * fm.DH
    assert slots["q"].index()[fm.REP, 0] == per_group  # the first query head of the second group
    perturb(model)
    kc.save_pretrained(model, tmp_path)
    again = fm.GroupedWqkvNet()
    again.load_state_dict({k: v for k, v in model.state_dict().items() if ".kha." not in k})
    kc.load_pretrained(again, tmp_path, example_args=(x,))
    assert torch.equal(again(x), model(x))


def test_routed_heads_fold_into_every_expert_and_the_report_says_so():
    model = fm.RoutedHeads()
    kc.apply(model, kc.KHAConfig(q="linear", k="linear", v="linear"), example_args=(_x(),))
    (site,) = kc.inspect(model, example_args=(_x(),)).matched
    assert "routed heads (mixture of attention heads)" in site.note and f"({fm.EXPERTS} calls)" in site.note
    assert sorted(kha_params(model)) == ["kha.q.weight", "kv.kha.k.weight", "kv.kha.v.weight"]


def test_graph_attention_with_additive_scores_is_a_skipped_site_with_the_reason():
    report = kc.inspect(fm.AdditiveGraphAttn(), example_args=(_x(0, (30, D)), _edges()))
    (site,) = report.sites
    assert site.status == "skipped" and site.anchor == "segment_softmax"
    assert "additive attention, as GAT" in site.reason


@pytest.mark.parametrize("v", ["linear", "mlp"])
def test_sliding_window_attention_written_as_chunked_einsums_matches_a_per_head_reference(v):
    """transformers' Longformer code: no value einsum right after the softmax (band padding between)."""
    pytest.importorskip("transformers")
    x = _x(0, (B, 32, D))
    args = fm.longformer_inputs(x)
    check_form(
        fm.longformer_attention,
        args,
        v,
        sites=1,
        anchor="einsum_softmax",
        qk=True,
        output=lambda y: y[0],
        reference=lambda m: fm.longformer_reference(m, x),
    )


@pytest.mark.parametrize("v", ["linear", "mlp"])
@pytest.mark.parametrize("cls", [fm.SharedKV, fm.SharedKVManual], ids=["sdpa", "manual_softmax"])
def test_keys_equal_to_values_get_their_transforms_on_the_attention_arguments(cls, v):
    """k = v: T^K and T^V on the key and value paths where they part; they do not fold, q does."""
    x = _x()
    torch.manual_seed(0)
    model = cls().eval()
    with torch.no_grad():
        before = model(x)
    kc.apply(model, kc.KHAConfig(q="linear", k="linear", v=v), example_args=(x,))
    (site,) = kc.inspect(model, example_args=(x,)).matched
    assert (site.num_heads, site.num_kv_heads, site.transforms["k"]) == (fm.H, 1, "linear")
    assert "k = v" in site.note and "not foldable" in site.note
    with torch.no_grad():
        assert torch.equal(model(x), before)
        perturb(model)
        moved = model(x)
        assert (moved - before).abs().max() > 1e-3
        torch.testing.assert_close(moved, model.reference(x), rtol=1e-4, atol=1e-5)
    with pytest.raises(kc.KHAError, match="cannot both fold into one weight"):
        kc.fold(model)
    kc.fold(model, strict=False)  # T^Q folds into q; T^K and T^V stay on the attention arguments
    assert sorted(kha_params(model)) == sorted(n for n in kha_params(model) if n.startswith("kha."))
    with torch.no_grad():
        torch.testing.assert_close(model(x), moved, rtol=1e-5, atol=1e-5)


def test_a_head_vector_mixed_over_the_sequence_by_a_convolution_is_skipped_naming_the_form():
    """ZAYA's compressed convolutional attention: q and k convolved over time after their projections."""

    class ConvQK(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q, self.k, self.v = (torch.nn.Linear(D, D) for _ in range(3))
            self.conv_q, self.conv_k = (torch.nn.Conv1d(D, D, 3, groups=fm.H, padding=2) for _ in range(2))

        def causal(self, conv, y):  # (B, S, D) -> a causal convolution over the sequence, per head
            return conv(y.transpose(1, 2))[..., : y.shape[1]].transpose(1, 2)

        def forward(self, x):
            q, k = fm.to_heads(self.causal(self.conv_q, self.q(x))), fm.to_heads(self.causal(self.conv_k, self.k(x)))
            return torch.nn.functional.scaled_dot_product_attention(q, k, fm.to_heads(self.v(x)))

    (site,) = kc.inspect(ConvQK(), example_args=(_x(),)).sites
    assert site.status == "skipped" and "mixed over the sequence by a convolution" in site.reason


@pytest.mark.parametrize("cls", [fm.SharedValueNet, fm.SharedKV], ids=["heads_as_modules", "k_equals_v"])
def test_save_load_and_remove_keep_and_drop_the_shared_transforms(cls, tmp_path):
    x = _x()
    torch.manual_seed(0)
    model = cls()
    kc.apply(model, kc.KHAConfig(q="linear", k="linear", v="mlp"), example_args=(x,))
    perturb(model)
    kc.save_pretrained(model, tmp_path)
    again = cls()
    again.load_state_dict({k: v for k, v in model.state_dict().items() if ".kha." not in f".{k}"})
    kc.load_pretrained(again, tmp_path, example_args=(x,))
    with torch.no_grad():
        assert torch.equal(again(x), model(x))
    kc.remove(again)
    assert not kha_params(again) and all(
        type(m).__module__ != "kha_compile.model.attention_inputs" for m in again.modules()
    )
    untouched = cls()
    untouched.load_state_dict(again.state_dict())
    with torch.no_grad():
        assert torch.equal(again(x), untouched(x))  # the original model, its classes and keys back
