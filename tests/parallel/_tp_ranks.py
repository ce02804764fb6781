"""Rank script of tests/parallel/test_tensor_parallel.py (run under torchrun; asserts inside, prints OK lines).

torchrun --standalone --nproc_per_node=2 tests/parallel/_tp_ranks.py tp
torchrun --standalone --nproc_per_node=4 tests/parallel/_tp_ranks.py fsdp_tp
"""

from __future__ import annotations

import copy
import functools
import sys

import torch
import torch.distributed as dist
import torch.distributed.tensor  # before kha_compile: then its import registers mlp_value's DTensor rule

import kha_compile as kc
from kha_compile.cli import tiny
from kha_compile.store.format import read_checkpoint

TOL = 1e-5


def kha_named(model):
    return {n: p for n, p in model.named_parameters() if ".kha." in f".{n}"}


def perturb(model, seed=1, scale=0.1):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(kha_named(model).items()):
            p.add_(scale * torch.randn(p.shape, generator=gen).to(p.dtype))


def full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def llama_plan(model):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {}
    for i in range(len(model.model.layers)):
        for p in ("q_proj", "k_proj", "v_proj"):
            plan[f"model.layers.{i}.self_attn.{p}"] = ColwiseParallel()
        plan[f"model.layers.{i}.self_attn.o_proj"] = RowwiseParallel()
    return plan


def neox_plan(model):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {}
    for i in range(len(model.gpt_neox.layers)):
        plan[f"gpt_neox.layers.{i}.attention.query_key_value"] = ColwiseParallel()
        plan[f"gpt_neox.layers.{i}.attention.dense"] = RowwiseParallel()
    return plan


def tiny_neox():
    """Fused query_key_value, interleaved per head [H, 3, Dh] (GPT-NeoX), tiny and seeded."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    torch.manual_seed(0)
    cfg = GPTNeoXConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=64,
        rotary_pct=0.5,
    )
    return GPTNeoXForCausalLM._from_config(cfg, attn_implementation="sdpa")


def make(name, cfg, **llama):
    """``name`` with KHA (``cfg``) and trained-like KHA weights: a copy of the one traced in this process."""
    model = copy.deepcopy(_applied(name, cfg, tuple(sorted(llama.items()))))
    perturb(model)
    return model


@functools.cache
def _applied(name, cfg, llama):
    llama = dict(llama)
    if name == "gpt_neox":
        model = tiny_neox()
    elif llama:
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        model = LlamaForCausalLM._from_config(LlamaConfig(**tiny.DECODER, **llama), attn_implementation="sdpa")
    else:
        model = tiny.make(name)
    model.train()
    kc.apply(model, cfg)
    return model


def steps(model, ids_list, n=2, lr=0.5, loss_group=None, eval_ids=None):
    """Losses, KHA grads of the first step, KHA weights after n SGD steps (full tensors), then no_grad logits.

    The logits are of ``eval_ids`` (default: the first batch).
    """
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses, grads = [], None
    for _ in range(n):
        opt.zero_grad()
        loss = sum(model(input_ids=ids, labels=ids, use_cache=False).loss for ids in ids_list) / len(ids_list)
        loss.backward()
        if grads is None:
            grads = {k: full(p.grad).clone() for k, p in kha_named(model).items()}
        opt.step()
        loss = loss.detach().clone()
        if loss_group is not None:  # data parallel: the mean over the data-parallel ranks
            dist.all_reduce(loss, group=loss_group)
            loss /= dist.get_world_size(loss_group)
        losses.append(float(loss))
    weights = {k: full(p.detach()).clone() for k, p in kha_named(model).items()}
    with torch.no_grad():  # after training: one process runs linear KHA weight-side here (tokens > d_model)
        logits = full(model(input_ids=ids_list[0] if eval_ids is None else eval_ids, use_cache=False).logits)
    return losses, grads, weights, logits


def compare(tag, got, ref):
    gl, gg, gw, go = got
    rl, rg, rw, ro = ref
    assert max(abs(a - b) for a, b in zip(gl, rl)) < TOL, (tag, "loss", gl, rl)
    assert (go - ro).abs().max() < TOL, (tag, "no_grad logits", float((go - ro).abs().max()))
    assert set(gg) == set(rg) and set(gw) == set(rw), (tag, sorted(gg), sorted(rg))
    for k in rg:
        assert (gg[k] - rg[k]).abs().max() < TOL, (tag, "grad", k, float((gg[k] - rg[k]).abs().max()))
        assert (gw[k] - rw[k]).abs().max() < TOL, (tag, "weight", k, float((gw[k] - rw[k]).abs().max()))
    return max(float(v.abs().max()) for v in rg.values())  # the gradients are not all zero


def same_on_every_rank(tag, weights):
    for k, w in weights.items():
        ws = [torch.empty_like(w) for _ in range(dist.get_world_size())]
        dist.all_gather(ws, w.contiguous())
        assert all(torch.equal(ws[0], x) for x in ws), (tag, "ranks differ", k)


LINEAR = kc.KHAConfig(q="linear", k="linear", v="linear")
MLP = kc.KHAConfig(q="linear", k="linear", v="mlp")


def check_mlp_value_dtensor(mesh):
    """kha::mlp_value on DTensor inputs: forward and backward equal the plain op."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    gen = torch.Generator().manual_seed(3)
    v = torch.randn(4, 6, 16, generator=gen)
    ws = [torch.eye(16) + 0.1 * torch.randn(16, 16, generator=gen) for _ in range(3)]
    ref_in = [t.clone().requires_grad_() for t in (v, *ws)]
    ref = torch.ops.kha.mlp_value(*ref_in)
    ref.sum().backward()
    for dim in (0, 1):
        dv = distribute_tensor(v, mesh, [Shard(dim)]).requires_grad_()
        dws = [distribute_tensor(w, mesh, [Replicate()]).requires_grad_() for w in ws]
        out = torch.ops.kha.mlp_value(dv, *dws)
        assert out.placements == (Shard(dim),), out.placements
        assert (out.full_tensor() - ref).abs().max() < TOL
        out.sum().backward()
        for a, b in zip((dv, *dws), ref_in):
            assert (full(a.grad) - b.grad).abs().max() < TOL, ("mlp_value grad", dim)
    print("OK mlp_value DTensor")


def plain_parallelize(model, mesh):
    from torch.distributed.tensor.parallel import parallelize_module

    return parallelize_module(model, mesh, llama_plan(model))  # torch's own call, after kc.apply


def refused_unchanged(model, calls, *needles):
    """Each of ``calls`` raises ShardedModelError with every one of ``needles`` in its message, and
    the model's state (gathered from every shard) and keys are unchanged."""
    before = {k: full(v).clone() for k, v in model.state_dict().items()}
    for call in calls:
        try:
            call()
        except kc.errors.ShardedModelError as e:
            assert all(n in str(e) for n in needles), e
        else:
            raise AssertionError(f"a sharded model was not refused ({needles[0]!r})")
    after = {k: full(v) for k, v in model.state_dict().items()}
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def check_transformers_tp_refused(out_dir):
    """from_pretrained(tp_plan="auto") shards with transformers' forwards: apply / load_pretrained refuse, untouched."""
    from transformers import AutoModelForCausalLM

    hf_dir = f"{out_dir}_hf"
    if dist.get_rank() == 0:
        tiny.make("tiny-llama").save_pretrained(hf_dir)
    dist.barrier()
    model = AutoModelForCausalLM.from_pretrained(hf_dir, tp_plan="auto")
    calls = (lambda: kc.apply(model, MLP), lambda: kc.load_pretrained(model, out_dir))
    refused_unchanged(model, calls, "sharded by transformers", "kc.parallelize(model, mesh, 'auto')")
    assert not any(".kha." in k for k in model.state_dict())
    print("OK tp transformers tp_plan refused")


def main_tp():
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    # 192 tokens > d_model (64): one process runs linear KHA weight-side, TP runs it token-side on local heads
    ids = torch.randint(0, 128, (3, 64), generator=torch.Generator().manual_seed(0))
    check_mlp_value_dtensor(mesh)
    for tag, cfg in (("linear", LINEAR), ("mlp", MLP)):
        ref = steps(make("tiny-llama", cfg), [ids])
        for how, shard in (
            ("kc", lambda m: kc.parallelize(m, mesh, llama_plan(m))),
            ("plain", lambda m: plain_parallelize(m, mesh)),
        ):
            model = make("tiny-llama", cfg)
            shard(model)
            got = steps(model, [ids])
            moved = compare(f"llama-{tag}-{how}", got, ref)
            same_on_every_rank(tag, got[2])
            print(f"OK tp {how} llama {tag} max|grad| {moved:.3g}")
    # plan="auto": the model's own transformers tp_plan (embeddings, MLP, lm_head too), tied embeddings kept tied
    tied = {"tie_word_embeddings": True, "num_key_value_heads": 2}
    ref = steps(make("tiny-llama", MLP, **tied), [ids])
    model = make("tiny-llama", MLP, **tied)
    kc.parallelize(model, mesh, "auto")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.model.layers[0].mlp.up_proj.weight.placements[0].is_shard(0)
    got = steps(model, [ids])
    moved = compare("llama-auto", got, ref)
    same_on_every_rank("auto", got[2])
    print(f"OK tp auto plan max|grad| {moved:.3g}")
    ref = steps(make("gpt_neox", MLP), [ids])
    model = make("gpt_neox", MLP)
    kc.parallelize(model, mesh, neox_plan(model))
    got = steps(model, [ids])
    moved = compare("neox", got, ref)
    same_on_every_rank("neox", got[2])
    print(f"OK tp fused-qkv max|grad| {moved:.3g}")
    # the sharded model refuses apply / inspect / fold, unchanged
    calls = (lambda: kc.apply(model, MLP), lambda: kc.inspect(model), lambda: kc.fold(model, strict=False))
    refused_unchanged(model, calls, "already sharded", "DTensor")
    print("OK tp refusals")
    # save_pretrained from every rank: rank 0 writes the full KHA weights
    out_dir = sys.argv[2]
    kc.save_pretrained(model, out_dir)
    if dist.get_rank() == 0:
        _, tensors = read_checkpoint(out_dir)
        assert set(tensors) == set(got[2]) and all(torch.equal(tensors[k], got[2][k]) for k in tensors)
    print("OK tp save")
    check_transformers_tp_refused(out_dir)
    # MQA: one kv head cannot be split over 2 ranks
    model = make("tiny-llama", MLP, num_key_value_heads=1)
    try:
        kc.parallelize(model, mesh, llama_plan(model))
    except kc.errors.TensorParallelError as e:
        assert "split across ranks" in str(e) and "divides" in str(e), e
    else:
        raise AssertionError("MQA over 2 ranks was not refused")
    model = make("tiny-llama", MLP, num_key_value_heads=1)
    plain_parallelize(model, mesh)  # torch's call cannot see KHA: the first forward refuses
    try:
        model(input_ids=ids[:, :8], use_cache=False)
    except kc.errors.TensorParallelError as e:
        assert "split across ranks" in str(e) and "kc.parallelize" in str(e), e
    else:
        raise AssertionError("MQA over 2 ranks was not refused after parallelize_module")
    print("OK tp mqa refused")


def main_fsdp_tp():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 128, (2, 48), generator=gen) for _ in range(2)]  # 96 tokens > d_model each
    ref = steps(make("tiny-llama", MLP), batches)
    model = make("tiny-llama", MLP)
    kc.parallelize(model, mesh["tp"], llama_plan(model))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    got = steps(model, [batches[mesh["dp"].get_local_rank()]], loss_group=mesh["dp"].get_group(), eval_ids=batches[0])
    moved = compare("fsdp+tp", got, ref)
    same_on_every_rank("fsdp+tp", got[2])
    print(f"OK fsdp+tp max|grad| {moved:.3g}")


if __name__ == "__main__":
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        {"tp": main_tp, "fsdp_tp": main_fsdp_tp}[sys.argv[1]]()
        dist.barrier()  # leave together: a rank tearing gloo down while another still works can abort
    finally:
        dist.destroy_process_group()
