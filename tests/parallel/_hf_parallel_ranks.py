"""Rank script of tests/parallel/test_transformers_parallel.py (torchrun, 2 CPU ranks; asserts inside, prints OK lines).

transformers' own parallel loading (``from_pretrained(d, distributed_config=...)``: its tensor-parallel
plan, ``model._tp_plan``, and its FSDP2 plan) on a model that carries KHA before the weights load,
as a subclass (or a quantizer) that applies KHA in ``__init__`` gives it. The reference is one process:
the same checkpoint loaded plainly, KHA applied after loading, the same trained-like KHA weights.

torchrun --standalone --nproc_per_node=2 tests/parallel/_hf_parallel_ranks.py OUT_DIR
"""

from __future__ import annotations

import json
import pathlib
import shutil
import sys

import torch
import torch.distributed as dist
import torch.distributed.tensor  # before kha_compile: its import then registers mlp_value's DTensor rule
from _tp_ranks import MLP, compare, kha_named, perturb, steps
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.distributed.configuration_utils import DistributedConfig

import kha_compile as kc

CONFIG = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
IDS = torch.randint(0, 128, (3, 64), generator=torch.Generator().manual_seed(0))  # 192 tokens > d_model 64


class KHALlama(LlamaForCausalLM):
    """A Llama that carries KHA from construction on: inside from_pretrained, before the weights load and
    before transformers shards it."""

    def __init__(self, config):
        super().__init__(config)
        kc.apply(self, MLP)


def reference(out_dir):
    model = LlamaForCausalLM.from_pretrained(f"{out_dir}/base")
    kc.apply(model, MLP)
    kha = KHALlama.from_pretrained(f"{out_dir}/kha")  # one process: the trained KHA weights, read back
    model.load_state_dict({k: v for k, v in kha.state_dict().items() if ".kha." in k}, strict=False)
    model.train()
    with torch.no_grad():
        logits = model(input_ids=IDS, use_cache=False).logits
    return logits, steps(model, [IDS])


def refused(call, *needles):
    try:
        call()
    except kc.KHAError as e:
        assert all(n in str(e) for n in needles), str(e)
        return
    raise AssertionError(f"not refused: {needles[0]!r}")


def main(out_dir):
    if dist.get_rank() == 0:
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**CONFIG, num_key_value_heads=2))
        model.save_pretrained(f"{out_dir}/base")
        kc.apply(model, MLP)
        perturb(model, scale=0.2)
        model.save_pretrained(f"{out_dir}/kha")  # transformers' own save: the .kha. tensors are in the weights
        # the same files with a config.json that does not record KHA (as a model's own KHA code would save them)
        shutil.copytree(f"{out_dir}/kha", f"{out_dir}/kha_unrecorded")
        cfg_path = pathlib.Path(out_dir, "kha_unrecorded", "config.json")
        entries = json.loads(cfg_path.read_text())
        del entries["kha_compile"], entries["quantization_config"]
        cfg_path.write_text(json.dumps(entries))
    dist.barrier()
    logits, ref = reference(out_dir)
    tp = DistributedConfig(tp_size=2)

    # KHA before transformers' tensor parallel, trained first: the projections adopt their local heads
    model = KHALlama.from_pretrained(f"{out_dir}/kha", distributed_config=tp)
    assert model.model.layers[0].self_attn.v_proj.weight.placements[0].is_shard(0)
    model.train()
    moved = compare("transformers tp", steps(model, [IDS]), ref)  # the no_grad logits run transformers' local path
    print(f"OK transformers tp trained max|grad| {moved:.3g}")

    # inference first, KHA put on by the model's own code and loaded without kha_compile's quantizer (which
    # adopts by itself): transformers runs the projections on local tensors, where the shard cannot be read
    model = KHALlama.from_pretrained(f"{out_dir}/kha_unrecorded", distributed_config=tp)
    with torch.no_grad():
        refused(lambda: model(input_ids=IDS, use_cache=False), "adopt_sharded_projections", "kc.parallelize")
        adopted = kc.parallel.adopt_sharded_projections(model)
        assert len(adopted) == 3 * CONFIG["num_hidden_layers"], adopted
        got = model(input_ids=IDS, use_cache=False).logits
    assert (got - logits).abs().max() < 1e-5, float((got - logits).abs().max())
    print("OK transformers tp inference after adopt")

    # by path, as a user loads it: kha_compile's quantizer applies KHA before the weights load and adopts the
    # local heads after transformers sharded them, so inference needs no further call
    model = LlamaForCausalLM.from_pretrained(f"{out_dir}/kha", distributed_config=tp)
    assert model.model.layers[0].self_attn.v_proj.weight.placements[0].is_shard(0)
    with torch.no_grad():
        got = model(input_ids=IDS, use_cache=False).logits
    assert (got - logits).abs().max() < 1e-5, float((got - logits).abs().max())
    model.train()
    moved = compare("from_pretrained tp", steps(model, [IDS]), ref)
    print(f"OK from_pretrained by path under tp, inference then training max|grad| {moved:.3g}")

    # KHA before transformers' FSDP2 plan: KHA's parameters are sharded with their layer
    model = KHALlama.from_pretrained(f"{out_dir}/kha", distributed_config=DistributedConfig(fsdp_size=2))
    assert all(type(p).__name__ == "DTensor" for p in kha_named(model).values())
    model.train()
    moved = compare("transformers fsdp", steps(model, [IDS]), ref)
    print(f"OK transformers fsdp2 trained max|grad| {moved:.3g}")

    # KHA after transformers sharded the model: refused, with the order that works
    model = LlamaForCausalLM.from_pretrained(f"{out_dir}/base", distributed_config=DistributedConfig(fsdp_size=2))
    refused(lambda: kc.apply(model, MLP), "distributed_config", "fully_shard")
    assert not kha_named(model)
    print("OK transformers fsdp then apply refused")


if __name__ == "__main__":
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        main(sys.argv[1])
        dist.barrier()
    finally:
        dist.destroy_process_group()
