"""Rank script of tests/parallel/test_regimes_distributed.py: DDP and FSDP2 with mixed precision.

For llama and qwen3, linear and MLP-value KHA: the pass-made model and KHA written by hand
(tests/handwritten.py), each wrapped the same way, train on this rank's batches; their per-step
losses, no_grad logits and greedy tokens must agree (tests/regimes.py: fp32 1e-5 relative for DDP,
a measured bound for FSDP2's bf16 parameters). Prints one OK line per check.

torchrun --standalone --nproc_per_node=2 tests/parallel/_regime_ranks.py
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

from regimes import KINDS, Regime, batches, compare, noise_bound, pair, train

MP = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def ddp(model):
    return DDP(model)


SEEN: set[torch.dtype] = set()  # dtypes of the v projection outputs under FSDP2


def fsdp_mixed(model):
    model.model.layers[0].self_attn.v_proj.register_forward_hook(lambda m, i, y: SEEN.add(y.dtype))
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=MP)
    fully_shard(model, mp_policy=MP)
    return model


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2 gradients), or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    for name, wrap, regime in (
        ("ddp", ddp, Regime("ddp")),
        ("fsdp2-bf16", fsdp_mixed, Regime("fsdp2-bf16", low_precision=True)),
    ):
        for arch in ("llama", "qwen3"):
            for kind in ("linear", "mlp"):
                data = batches(regime.steps, seed=100 + rank)  # each rank its own batches
                made, _, untouched = pair(arch, KINDS[kind], seed=None)  # identity at init, wrapped alike
                a, b = wrap(made), wrap(untouched)
                ids = data[0]
                ya, yb = a(input_ids=ids, labels=ids), b(input_ids=ids, labels=ids)
                assert torch.equal(ya.logits, yb.logits), f"{name}: identity at init is not exact"
                ya.loss.backward()
                yb.loss.backward()
                grads = [
                    {n: p.grad for n, p in m.named_parameters() if p.grad is not None and ".kha." not in f".{n}"}
                    for m in (made, untouched)
                ]
                assert grads[0].keys() == grads[1].keys()
                assert all(torch.equal(_local(grads[0][n]), _local(grads[1][n])) for n in grads[0])
                print(f"OK {name} {arch} {kind} identity at init", flush=True)
                made, hand, _ = pair(arch, KINDS[kind])
                got = train(made, regime, data, wrap=wrap)
                want = train(hand.model, regime, data, wrap=wrap)
                if name == "fsdp2-bf16":  # the projections (and their KHA) really computed in bf16
                    assert {torch.bfloat16} == SEEN, SEEN
                bound = noise_bound(want, regime, arch, KINDS[kind], data, wrap=wrap)
                gaps = compare(got, want, bound, f"rank {rank}, {name}, {arch}, {kind} KHA")
                # the ranks trained one model: their weights agree after the steps
                probe = torch.stack([got.logits.flatten()[:64]])
                gathered = [torch.zeros_like(probe) for _ in range(dist.get_world_size())]
                dist.all_gather(gathered, probe)
                assert all(torch.allclose(g, gathered[0], rtol=0, atol=1e-6) for g in gathered)
                print(f"OK {name} {arch} {kind} equals hand-written: gaps {gaps} ({bound.measured})", flush=True)
                if kind == "mlp" and arch == "qwen3":  # a role left out of the hand-written model is caught
                    made, hand, _ = pair(arch, KINDS[kind], drop=("v",))
                    got, want = train(made, regime, data, wrap=wrap), train(hand.model, regime, data, wrap=wrap)
                    bound = noise_bound(want, regime, arch, KINDS[kind], data, wrap=wrap, drop=("v",))
                    try:
                        compare(got, want, bound)
                    except AssertionError:
                        print(f"OK {name} catches a missing role", flush=True)
    dist.barrier()  # leave together: a rank tearing gloo down while another still works can abort
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
