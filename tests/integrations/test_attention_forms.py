"""Attention forms from code nobody here wrote (diffusion, vision, speech, MoE): every site matched,
exact identity at init, the perturbed output equal to an independent per-head reference
(``tests/forms_zoo.py``), and linear KHA (q, k and v) folded exactly."""

from __future__ import annotations

import pytest
import torch

import forms_zoo as fz
import kha_compile as kc
from form_checks import check_form
from helpers import kha_params, perturb
from kha_compile.core.errors import NoAttentionFoundError

B, S, D = fz.B, fz.S, fz.D


def _x(seed: int = 0, shape: tuple[int, ...] = (B, S, D)) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _tokens(padded: bool) -> torch.Tensor:
    ids = torch.randint(1, 16, (B, S), generator=torch.Generator().manual_seed(0))
    if padded:
        ids[1, -5:] = 0
    return ids


# name -> (model class, inputs, sites, grad)
FORMS = {
    "zip_of_a_slice": (fz.ZipNet, lambda: (_x(),), 2, True),
    "joint_streams": (fz.JointNet, lambda: (_x(0, (B, 6, D)), _x(1)), 2, True),
    "sum_of_projections": (fz.SumNet, lambda: (_x(), _x(1)), 2, True),
    "self_and_cross": (fz.SelfCrossNet, lambda: (_x(), _x(1, (B, 7, D))), 2, True),
    "talking_heads": (fz.TalkingNet, lambda: (_x(),), 2, True),
    "learned_query": (fz.ClassAttnNet, lambda: (_x(),), 2, True),
    "autocast_and_no_grad_regions": (fz.RegionsNet, lambda: (_x(),), 2, True),
    "abc_first_bases": (fz.ABCNet, lambda: (_x(),), 2, True),
    "untraceable_whole": (fz.Untraceable, lambda: (_tokens(True),), 2, True),
    "untraceable_whole_unpadded": (fz.Untraceable, lambda: (_tokens(False),), 2, True),
    "conv1d_pointwise": (fz.ConvNet, lambda: (_x(0, (B, D, S)),), 2, True),
    "local_and_global_tokens": (fz.LocalGlobalNet, lambda: (_x(),), 2, True),
    "local_and_global_split_probabilities": (fz.SplitNet, lambda: (_x(),), 2, True),
    "layer_reused_in_a_loop": (fz.LoopNet, lambda: (_x(),), 3, True),
    "tuple_returning_projection": (fz.TupleNet, lambda: (_x(),), 2, True),
    "vit_cat_bias_partial_rope": (fz.ViTNet, lambda: (_x(),), 2, True),
    "flex_block_mask_input": (
        fz.FlexLlama,
        lambda: (_tokens(False) % 16, torch.arange(S).expand(B, S), fz.causal_block_mask(S)),
        2,
        False,  # torch has no flex_attention backward on CPU
    ),
}


@pytest.mark.parametrize("v", ["linear", "mlp"])
@pytest.mark.parametrize("form", sorted(FORMS))
def test_form_matches_a_per_head_reference(form, v):
    cls, inputs, sites, grad = FORMS[form]
    args = inputs()
    check_form(cls, args, v, sites=sites, grad=grad, qk=True, reference=lambda m: m.reference(*args))


def test_joint_streams_share_one_transform_per_role():
    """One site, several projections per role; the image projections hold the text projection's
    transforms by reference (one parameter, one name), and fold writes T into both."""
    model = fz.JointNet()
    args = (_x(0, (B, 6, D)), _x(1))
    kc.apply(model, kc.KHAConfig(q="linear", k="linear", v="linear"), example_args=args)
    (site, _) = kc.inspect(model, example_args=args).matched
    assert site.join == {"q": "cat", "k": "cat", "v": "cat"}
    assert site.joint == {r: [f"blocks.0.img_{r}"] for r in "qkv"}
    names = [n for n in kha_params(model) if n.startswith("blocks.0.")]
    assert names == [f"blocks.0.txt_qkv.kha.{r}.weight" for r in "qkv"]
    assert model.blocks[0].img_q.kha["q"] is model.blocks[0].txt_qkv.kha["q"]
    assert all(".kha." not in k or ".txt_qkv." in k for k in model.state_dict())  # once each


def test_a_value_that_is_a_sum_gets_linear_kha_but_no_mlp_value():
    x, pos = _x(), _x(1)
    model = fz.SumV()
    report = kc.inspect(model, example_args=(x, pos))
    assert report.matched[0].join == {"v": "sum"}
    kc.apply(model, kc.KHAConfig(v="linear"), example_args=(x, pos))
    assert set(kha_params(model)) == {"va.kha.v.weight"}
    with pytest.raises(NoAttentionFoundError, match=r"v: the head vector is a sum of projections \(va, vb\)"):
        kc.apply(fz.SumV(), kc.KHAConfig(v="mlp"), example_args=(x, pos))


def test_untraceable_model_is_traced_per_submodule_and_the_report_says_why():
    model = fz.Untraceable()
    report = kc.inspect(model, example_args=(_tokens(True),))
    assert report.trace_path.startswith("per submodule (the whole-model trace failed")
    assert "if not pad.any():" in report.trace_path
    assert [s.name for s in report.matched] == ["layers.0.attn", "layers.1.attn"]
    assert {p for p, _ in report.untraced} >= {"layers.0", "layers.0.moe"}


def test_each_call_of_a_reused_layer_is_one_site_on_the_same_projections():
    model = fz.LoopNet()
    report = kc.inspect(model, example_args=(_x(),))
    assert len(report.matched) == 3
    assert {(s.q_proj, s.k_proj, s.v_proj) for s in report.matched} == {("layer.q", "layer.k", "layer.v")}


def test_abc_first_classes_get_their_kha_subclass_and_back():
    model = fz.ABCNet()
    x = _x()
    kc.apply(model, kc.KHAConfig(q="linear", v="mlp"), example_args=(x,))
    assert isinstance(model.a, fz.ABCAttn) and type(model.a) is not fz.ABCAttn
    assert isinstance(model.b.q, fz.ABCLinear) and type(model.b.q) is not fz.ABCLinear
    kc.remove(model)
    assert type(model.a) is fz.ABCAttn and type(model.b.q) is fz.ABCLinear


def test_a_model_config_that_is_not_transformers_is_left_alone_and_saved_with_the_weights(tmp_path):
    class Config:
        heads = fz.H

    model = fz.ZipNet()
    model.config = Config()
    x = _x()
    kc.apply(model, kc.KHAConfig(v="linear"), example_args=(x,))
    assert not hasattr(model.config, "kha_compile")
    perturb(model)
    kc.save_pretrained(model, tmp_path)
    again = fz.ZipNet()
    again.load_state_dict({k: v for k, v in model.state_dict().items() if ".kha." not in k})
    again.config = Config()
    kc.load_pretrained(again, tmp_path, example_args=(x,))
    torch.testing.assert_close(again(x), model(x), rtol=0, atol=0)


def test_nothing_found_names_the_nearest_candidate_and_where_the_walk_stopped():
    class Gated(fz.SelfAttn):  # v is the product of two projections: not a head split KHA can carry
        def forward(self, x):
            q, k = fz.to_heads(self.q(x)), fz.to_heads(self.k(x))
            v = fz.to_heads(self.v(x) * torch.sigmoid(self.o(x)))
            return torch.nn.functional.scaled_dot_product_attention(q, k, v)

    with pytest.raises(
        NoAttentionFoundError,
        match=r"Nearest candidate: scaled_dot_product_attention \(rule sdpa; k, q traced back to projections\); "
        r"the walk stopped: v: the head vector comes from several per-head projections",
    ):
        kc.apply(Gated(), kc.KHAConfig(v="linear"), example_args=(_x(),))


def test_joint_streams_export_to_onnx_with_one_mlp_value_node_per_projection(tmp_path):
    """Fold folds T^Q, T^K into every stream's projection; the shared MLP-value runs after each."""
    ort = pytest.importorskip("onnxruntime")
    model = fz.JointNet()
    args = (_x(0, (B, 6, D)), _x(1))
    kc.apply(model, kc.KHAConfig(q="linear", k="linear", v="mlp"), example_args=args)
    perturb(model)
    with torch.no_grad():
        want = model(*args)
    path = kc.export_onnx(model, tmp_path / "joint.onnx", example_args=args, dynamic=False)
    import onnx

    nodes = [n for n in onnx.load(str(path)).graph.node if n.domain not in ("", "ai.onnx")]
    assert len(nodes) == 4  # v of txt_qkv and of img_v, in each of 2 blocks
    sess = ort.InferenceSession(str(path))
    feed = {i.name: a.numpy() for i, a in zip(sess.get_inputs(), args)}
    (y,) = sess.run(None, feed)
    torch.testing.assert_close(torch.from_numpy(y), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("v", ["linear", "mlp"])
def test_tied_projections_share_one_transform_and_fold_exactly(v):
    args = (_x(),)
    model = check_form(fz.TiedNet, args, v, qk=True, reference=lambda m: m.reference(*args))
    if v == "mlp":
        assert [n for n in kha_params(model) if n.endswith("v.up")] == ["blocks.0.v.kha.v.up"]


def test_keys_equal_to_values_get_transforms_on_the_attention_arguments():
    """K = V from one projection: T^V on the value argument of the attention, nothing after ``kv``
    (tests/integrations/test_attention_forms_more.py checks the per-head reference)."""
    model = fz.KEqualsV()
    kc.apply(model, kc.KHAConfig(v="mlp"), example_args=(_x(),))
    (site,) = kc.inspect(model, example_args=(_x(),)).matched
    assert site.transforms == {"v": "mlp"} and "k = v" in site.note
    assert sorted(kha_params(model)) == ["kha.v.down", "kha.v.gate", "kha.v.up"]


def test_a_grouped_conv_whose_groups_cut_the_heads_is_skipped_with_the_reason():
    x = _x(0, (B, D, 12))
    with pytest.raises(NoAttentionFoundError, match=r"span several of its 8 conv groups"):
        kc.apply(fz.GroupedConv(8), kc.KHAConfig(v="linear"), example_args=(x,))
    check_form(lambda: fz.GroupedConv(4), (x,), "linear", sites=1)  # groups of 24 channels: whole heads


def test_joint_streams_survive_save_load_deepcopy_and_remove(tmp_path):
    import copy

    args = (_x(0, (B, 6, D)), _x(1))
    model = fz.JointNet()
    kc.apply(model, kc.KHAConfig(q="linear", k="linear", v="mlp"), example_args=args)
    perturb(model)
    kc.save_pretrained(model, tmp_path)
    again = fz.JointNet()
    again.load_state_dict({k: v for k, v in model.state_dict().items() if ".kha." not in k})
    kc.load_pretrained(again, tmp_path, example_args=args)
    assert torch.equal(again(*args), model(*args))
    twin = copy.deepcopy(model)
    assert twin.blocks[0].img_q.kha["q"] is twin.blocks[0].txt_qkv.kha["q"]
    assert torch.equal(twin(*args), model(*args))
    kc.remove(again)
    assert type(again.blocks[0].img_q) is torch.nn.Linear and "kha" not in vars(again.blocks[0].img_q)
