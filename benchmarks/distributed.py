"""Training-step time and communication with KHA / without, under FSDP2 and under tensor parallel (2 CPU ranks).

A Llama-like model (hidden 256, 4 q / 2 kv heads of size 64, 2 layers, seq 128, batch 2), KHA-MLP
on v (the paper's default). Each rank holds four models: FSDP2 without / with KHA, TP without /
with KHA (kc.parallelize; q/k/v and MLP gate/up ColwiseParallel, o/down RowwiseParallel); their SGD
steps run in turns (a, b, c, d, then b, c, d, a, ...: the order rotates) and the step times are medians
over the repeats.

Communication: a TorchDispatchMode counts every collective (c10d and functional collectives) and
its bytes (the full tensor: all-gather output, reduce-scatter input, all-reduce tensor). What KHA
adds per step should match, with P the KHA parameter count (fp32, 4 bytes):
  FSDP2: 3 * 4 * P bytes (all-gather in forward, again in backward, reduce-scatter of the grads)
  TP:    4 * P bytes     (all-reduce of the KHA grads over the TP group; the forward adds nothing)

    python benchmarks/distributed.py [--repeats 20] [--json out.json]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist
from _common import machine, write_json
from torch.utils._python_dispatch import TorchDispatchMode

import kha_compile as kc

COMM_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional")


def _bytes(x: Any) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_bytes(y) for y in x)
    return 0


class CommCounter(TorchDispatchMode):
    """Counts collectives and their bytes (largest of the op's tensor arguments and its output)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0
        self.calls: dict[str, int] = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if func.namespace in COMM_NAMESPACES and not func.__name__.startswith(("wait", "barrier")):
            self.calls[func.__name__.split(".")[0]] += 1
            self.bytes += max([_bytes(a) for a in args] + [_bytes(out)])
        return out


def build(seed: int = 0):  # type: ignore[no-untyped-def]
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1024,
        max_position_embeddings=256,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa").train(), cfg


def tp_plan(model) -> dict:  # type: ignore[no-untyped-def]
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan: dict = {}
    for i in range(len(model.model.layers)):
        p = f"model.layers.{i}."
        plan |= {p + f"self_attn.{n}": ColwiseParallel() for n in ("q_proj", "k_proj", "v_proj")}
        plan |= {p + f"mlp.{n}": ColwiseParallel() for n in ("gate_proj", "up_proj")}
        plan |= {p + "self_attn.o_proj": RowwiseParallel(), p + "mlp.down_proj": RowwiseParallel()}
    return plan


def variants(world: int) -> tuple[dict, int]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    models, kha_params = {}, 0
    for kind in ("fsdp2", "tp"):
        for with_kha in (False, True):
            model, _ = build()
            if with_kha:
                kc.apply(model, kc.KHAConfig(v="mlp"))
                kha_params = sum(p.numel() for n, p in model.named_parameters() if ".kha." in n)
            if kind == "tp":
                kc.parallelize(model, mesh, tp_plan(model))
            else:
                for layer in model.model.layers:
                    fully_shard(layer, mesh=mesh)
                fully_shard(model, mesh=mesh)
            models[(kind, with_kha)] = model
    return models, kha_params


def step_fn(model, ids):  # type: ignore[no-untyped-def]
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        opt.step()

    return step


def rank_main(rank: int, world: int, port: int, args: argparse.Namespace, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        models, kha_params = variants(world)
        ids = torch.randint(0, 1024, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
        steps = {k: step_fn(m, ids) for k, m in models.items()}
        comm = {}
        for k, fn in steps.items():  # warm-up step, then one counted step
            fn()
            with CommCounter() as c:
                fn()
            comm[k] = (c.bytes, dict(c.calls))
        times: dict = {k: [] for k in steps}
        order = list(steps)
        for r in range(args.repeats):
            for k in order[r % len(order) :] + order[: r % len(order)]:  # rotate: no variant always follows another
                fn = steps[k]
                dist.barrier()
                start = time.perf_counter()
                fn()
                dist.barrier()
                times[k].append(time.perf_counter() - start)
        if rank == 0:
            out.update(kha_params=kha_params, comm=comm, times=times)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank0(rank: int, world: int, port: int, args: argparse.Namespace, queue: Any) -> None:
    out: dict = {}
    rank_main(rank, world, port, args, out)
    if rank == 0:
        queue.put(out)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    ctx = torch.multiprocessing.get_context("spawn")
    queue = ctx.SimpleQueue()
    torch.multiprocessing.start_processes(
        _rank0, args=(args.world, _free_port(), args, queue), nprocs=args.world, start_method="spawn"
    )
    res = queue.get()
    P = res["kha_params"]
    formula = {"fsdp2": 3 * 4 * P, "tp": 4 * P}
    print(
        f"Llama hidden 256, 2 layers, 4 q / 2 kv heads (head dim 64), seq {args.seq}, batch {args.batch}; "
        f"{args.world} CPU ranks (gloo, 1 thread each); KHA-MLP on v: {P} parameters; "
        f"{args.repeats} steps each, in turns; medians"
    )
    record: dict = {"kha_params": P, "world": args.world, "seq": args.seq, "batch": args.batch, "repeats": args.repeats}
    for kind in ("fsdp2", "tp"):
        base, kha = (statistics.median(res["times"][(kind, f)]) for f in (False, True))
        base_min, kha_min = (min(res["times"][(kind, f)]) for f in (False, True))
        (b0, c0), (b1, c1) = res["comm"][(kind, False)], res["comm"][(kind, True)]
        added = b1 - b0
        extra_calls = {
            k: c1.get(k, 0) - c0.get(k, 0) for k in sorted(set(c0) | set(c1)) if c1.get(k, 0) != c0.get(k, 0)
        }
        print(
            f"  {kind:5s} step: no KHA {base * 1e3:7.1f} ms   KHA {kha * 1e3:7.1f} ms   ratio median "
            f"{kha / base:5.3f}  min {kha_min / base_min:5.3f}"
        )
        print(
            f"  {kind:5s} comm/step per rank: no KHA {b0:9d} B   KHA {b1:9d} B   added {added:7d} B   "
            f"formula {formula[kind]:7d} B ({'matches' if added == formula[kind] else 'DIFFERS'}); "
            f"extra collectives {extra_calls}"
        )
        record[kind] = {
            "step_s": base,
            "kha_step_s": kha,
            "ratio": kha / base,
            "min_ratio": kha_min / base_min,
            "comm_bytes": b0,
            "kha_comm_bytes": b1,
            "added_bytes": added,
            "formula_bytes": formula[kind],
            "extra_collectives": extra_calls,
            "calls": c0,
            "kha_calls": c1,
        }
    load = os.getloadavg()[0]
    record["load_average_1min"] = load
    print(
        f"  formula: FSDP2 3 * 4 * P (all-gather fwd + bwd, reduce-scatter), TP 4 * P (grad all-reduce); "
        f"machine {machine()}, load average {load:.1f} on {os.cpu_count()} cores (timings are noisy when it "
        "exceeds the core count; the byte counts are exact)"
    )
    write_json(args.json, record)
    return record


if __name__ == "__main__":
    main()
