"""build_sites / insert: MLA's transforms (docs/method.md, "Multi-head latent attention") and the plan they follow."""

from __future__ import annotations

import torch

import kha_compile as kc
import zoo
from helpers import kha_params, run
from kha_compile.handlers.plan import MLA_NOTE


def test_mla_tq_covers_the_whole_query_head_and_tk_the_per_head_no_rope_key_part():
    """Decision (docs/method.md, MLA): every transform acts on what a per-head projection produces and folds
    into an up-projection. T^Q covers the whole query head (no-RoPE + RoPE, all from q_b_proj);
    T^K covers the per-head no-RoPE key part of kv_b_proj; the RoPE key piece is shared by all heads
    (kv_a_proj_with_mqa) and stays untouched, so absorption and the shared cache survive."""
    case = zoo.make("deepseek_v3")
    cfg = case.model.config
    nope, rope, dv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    with torch.no_grad():
        ref = run(case)
    kc.apply(case.model, kc.KHAConfig(q="linear", k="linear", v="linear"))
    report = kc.inspect(case.model)
    assert report.matched and all(s.kind == "mla" and s.note == MLA_NOTE for s in report.matched)
    assert "T^Q acts on the whole query head" in MLA_NOTE and "T^K on the per-head no-RoPE key part" in MLA_NOTE
    shapes = {n.split("self_attn.")[1]: tuple(p.shape) for n, p in kha_params(case.model).items() if ".layers.0." in n}
    assert shapes == {
        "q_b_proj.kha.q.weight": (nope + rope, nope + rope),
        "kv_b_proj.kha.k.weight": (nope, nope),
        "kv_b_proj.kha.v.weight": (dv, dv),
    }
    attn = case.model.model.layers[0].self_attn
    assert not hasattr(attn.kv_a_proj_with_mqa, "kha")  # the shared RoPE key piece has no transform
    slots = {s.role: s for s in attn.kv_b_proj._kha_slots}
    assert (slots["k"].offset, slots["k"].head_dim, slots["k"].head_stride) == (0, nope, nope + dv)

    with torch.no_grad():  # T^Q mixes no-RoPE features into the RoPE part of the query head
        for layer in case.model.model.layers:
            layer.self_attn.q_b_proj.kha.q.weight[:nope, nope:] += 0.5 * torch.randn(nope, rope)
        trained = run(case)
    assert not torch.allclose(trained, ref, atol=1e-5)
    kc.fold(case.model)  # and it folds exactly into q_b_proj, like T^K and T^V into kv_b_proj
    assert not kha_params(case.model) and type(attn.q_b_proj) is torch.nn.Linear
    with torch.no_grad():
        torch.testing.assert_close(run(case), trained, rtol=1e-4, atol=1e-4)
