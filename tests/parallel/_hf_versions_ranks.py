"""Rank script of tests/parallel/test_transformers_versions.py (torchrun, 2 CPU ranks; asserts inside, prints OK lines).

Runs under any transformers release of pyproject's range (the main venv's, or a side environment of
scripts/hf_env.sh) and needs only transformers and kha_compile. transformers tensor-parallelises a
tiny Llama itself (``from_pretrained(d, tp_plan="auto")``, or ``distributed_config`` where ``tp_plan``
is gone); releases differ in how (DTensor weights, or plain local shards marked on the module).
Two orders, each either right or refused with a KHAError, never silently wrong:

- KHA applied after transformers sharded the model (``kc.apply``);
- KHA applied before (a subclass that applies it in ``__init__``), then trained.

"Right" is the reference of one process: the same checkpoint loaded plainly, KHA applied, the same
trained-like KHA weights; the loss and every KHA gradient (gathered whole) within 1e-5.

torchrun --standalone --nproc_per_node=2 tests/parallel/_hf_versions_ranks.py OUT_DIR
"""

from __future__ import annotations

import json
import pathlib
import sys

import torch
import torch.distributed as dist
import torch.distributed.tensor  # before kha_compile: its import then registers mlp_value's DTensor rule
import transformers
from transformers import LlamaConfig, LlamaForCausalLM

import kha_compile as kc

TOL = 1e-5
CFG = kc.KHAConfig(q="linear", k="linear", v="mlp")
CONFIG = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
IDS = torch.randint(0, 128, (3, 64), generator=torch.Generator().manual_seed(0))  # 192 tokens > d_model 64


class KHALlama(LlamaForCausalLM):
    """KHA from construction on: inside from_pretrained, before the weights load and transformers shards them."""

    def __init__(self, config):
        super().__init__(config)
        kc.apply(self, CFG)


def perturb(model):
    """Trained-like KHA weights, the same on every rank and in every order (KHA's transforms are replicated)."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if ".kha." in name:
                local = p.to_local() if isinstance(p, torch.distributed.tensor.DTensor) else p
                assert local.shape == p.shape, (name, "a KHA transform is not whole on this rank")
                local.add_(0.1 * torch.randn(p.shape, generator=gen))


def full(t):
    return t.full_tensor() if isinstance(t, torch.distributed.tensor.DTensor) else t


def loss_and_grads(model):
    model.train()
    loss = model(input_ids=IDS, labels=IDS, use_cache=False).loss
    loss.backward()
    return float(full(loss)), {n: full(p.grad) for n, p in model.named_parameters() if ".kha." in n}


def load_tp(cls, path):
    """``cls.from_pretrained(path)`` tensor-parallel over the 2 ranks, the way this transformers release offers."""
    if int(transformers.__version__.split(".")[0]) < 5:  # 4.x: tp_plan; 5.x: distributed_config (5.15 has no tp_plan)
        return cls.from_pretrained(path, tp_plan="auto")
    from transformers.distributed.configuration_utils import DistributedConfig

    return cls.from_pretrained(path, distributed_config=DistributedConfig(tp_size=2))


def right_or_refused(tag, run, ref):
    """``run()`` gives the reference loss and KHA gradients, or raises a KHAError: the outcome's word."""
    try:
        loss, grads = run()
    except kc.KHAError as e:
        print(f"[{dist.get_rank()}] {tag} refused: {type(e).__name__}: {str(e)[:300]}", file=sys.stderr)
        return "refused"
    ref_loss, ref_grads = ref
    assert abs(loss - ref_loss) < TOL, (tag, "loss", loss, ref_loss)
    assert set(grads) == set(ref_grads) and ref_grads, (tag, sorted(grads), sorted(ref_grads))
    for k, g in ref_grads.items():
        assert grads[k] is not None and (grads[k] - g).abs().max() < TOL, (tag, "grad", k, grads[k], g)
    return "right"


def main(out_dir):
    if dist.get_rank() == 0:
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**CONFIG, num_key_value_heads=2))
        model.save_pretrained(f"{out_dir}/base")
        kc.apply(model, CFG)
        perturb(model)
        model.save_pretrained(f"{out_dir}/kha")  # transformers' own save: the .kha. tensors are in the weights
        # a config.json that does not record KHA, as the model's own KHA code (KHALlama) would save it
        cfg_path = pathlib.Path(out_dir, "kha", "config.json")
        entries = json.loads(cfg_path.read_text())
        entries.pop("kha_compile", None), entries.pop("quantization_config", None)
        cfg_path.write_text(json.dumps(entries))
    dist.barrier()
    model = LlamaForCausalLM.from_pretrained(f"{out_dir}/base")
    kc.apply(model, CFG)
    perturb(model)
    ref = loss_and_grads(model)
    assert max(float(g.abs().max()) for g in ref[1].values()) > 1e-4  # the gradients are not all zero

    def after():
        model = load_tp(LlamaForCausalLM, f"{out_dir}/base")
        assert kc.parallel.is_sharded(model), "transformers did not shard the model"
        kc.apply(model, CFG)
        perturb(model)
        return loss_and_grads(model)

    def before():
        model = load_tp(KHALlama, f"{out_dir}/kha")
        assert kc.parallel.is_sharded(model), "transformers did not shard the model"
        return loss_and_grads(model)

    for tag, run in (("apply after transformers tp", after), ("apply before transformers tp", before)):
        print(f"OK {tag}: {right_or_refused(tag, run, ref)} (transformers {transformers.__version__})", flush=True)


if __name__ == "__main__":
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        main(sys.argv[1])
        dist.barrier()
    finally:
        dist.destroy_process_group()
