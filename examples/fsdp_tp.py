"""Train a Llama with KHA under FSDP2 + tensor parallel (a 2 x 2 mesh), save, and fold in one process.

Runs on CPU with gloo (or on GPUs with nccl: pass --device cuda):

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=4 examples/fsdp_tp.py

Order of calls: kc.apply on the plain model -> kc.parallelize (TP, the usual plan, unchanged) ->
fully_shard (FSDP2 over the data-parallel axis) -> train -> kc.save_pretrained on every rank
(rank 0 writes) -> in one process: kc.load_pretrained into the base model, kc.fold.
"""

from __future__ import annotations

import argparse
import tempfile

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from transformers import LlamaConfig, LlamaForCausalLM

import kha_compile as kc


def build() -> LlamaForCausalLM:
    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    torch.manual_seed(0)  # the same base weights on every rank (and in the single-process check)
    return LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa")


def tp_plan(model: LlamaForCausalLM) -> dict:
    plan: dict = {}
    for i in range(model.config.num_hidden_layers):
        p = f"model.layers.{i}."
        plan |= {p + f"self_attn.{n}": ColwiseParallel() for n in ("q_proj", "k_proj", "v_proj")}
        plan |= {p + f"mlp.{n}": ColwiseParallel() for n in ("gate_proj", "up_proj")}
        plan |= {p + "self_attn.o_proj": RowwiseParallel(), p + "mlp.down_proj": RowwiseParallel()}
    return plan


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    dist.init_process_group("gloo" if args.device == "cpu" else "nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    tp = 2 if world % 2 == 0 else 1
    mesh = init_device_mesh(args.device, (world // tp, tp), mesh_dim_names=("dp", "tp"))

    model = build().to(args.device).train()
    kc.apply(model, kc.KHAConfig(q="linear", k="linear", v="linear"))  # 1. on the plain model
    kc.parallelize(model, mesh["tp"], tp_plan(model))  # 2. tensor parallel
    for layer in model.model.layers:  # 3. FSDP2 over "dp"
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(100 + mesh["dp"].get_local_rank())  # data differs per dp rank
    for step in range(args.steps):
        ids = torch.randint(0, 256, (4, 32), generator=gen).to(args.device)
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if rank == 0:
            print(f"step {step}: loss {loss.item():.4f}")

    # KHA weights only, like an adapter. Every rank calls it; rank 0 writes a complete checkpoint.
    # (The base weights trained too: gather them with torch.distributed.checkpoint's get_model_state_dict.)
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
    )

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    directory = tempfile.mkdtemp() if rank == 0 else ""
    holder = [directory]
    dist.broadcast_object_list(holder, src=0)
    kc.save_pretrained(model, holder[0])
    if rank == 0:  # one process, no sharding: base weights + KHA checkpoint -> fold -> vanilla Llama
        plain = build()
        plain.load_state_dict({k: v for k, v in full.items() if ".kha." not in k}, strict=True)
        kc.load_pretrained(plain, holder[0])
        probe = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            before = plain(input_ids=probe).logits
            kc.fold(plain)
            after = plain(input_ids=probe).logits
        print(
            f"saved to {holder[0]}; folded into a vanilla {type(plain).__name__}: "
            f"max |logits difference| {float((before - after).abs().max()):.2e}"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
