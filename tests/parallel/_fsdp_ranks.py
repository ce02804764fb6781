"""Rank script of tests/parallel/test_fsdp.py (run under torchrun; asserts inside, prints OK lines).

torchrun --standalone --nproc_per_node=2 tests/parallel/_fsdp_ranks.py OUT_DIR
"""

from __future__ import annotations

import pathlib
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.fsdp import fully_shard

import kha_compile as kc
from kha_compile.cli import tiny
from kha_compile.core.errors import ShardedModelError

TOL = 1e-5
LINEAR = kc.KHAConfig(q="linear", k="linear", v="linear")


def shard(model):
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def kha_model():
    model = tiny.make("tiny-llama").train()
    kc.apply(model, LINEAR)
    return model


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


def train_step(model, ids, params):
    opt = torch.optim.SGD(params, lr=0.5)
    opt.zero_grad()
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    opt.step()
    return float(loss)


def full_state(model):
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def check_ddp() -> None:
    """kc.apply, then DDP: 2 SGD steps on per-rank batches equal one process on both batches."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    gen = torch.Generator().manual_seed(5)
    batches = [torch.randint(0, 128, (2, 8), generator=gen) for _ in range(2)]
    ref, model = kha_model(), kha_model()
    ddp = DDP(model)
    for _ in range(2):
        opt_r, opt_d = torch.optim.SGD(ref.parameters(), lr=0.5), torch.optim.SGD(ddp.parameters(), lr=0.5)
        opt_r.zero_grad()
        (sum(ref(input_ids=b, labels=b, use_cache=False).loss for b in batches) / 2).backward()
        opt_r.step()
        opt_d.zero_grad()
        b = batches[dist.get_rank()]
        ddp(input_ids=b, labels=b, use_cache=False).loss.backward()
        opt_d.step()
    want = {n: p for n, p in ref.named_parameters() if ".kha." in n}
    got = {n: p for n, p in model.named_parameters() if ".kha." in n}
    assert want.keys() == got.keys() and want
    assert max(float((want[n] - got[n]).abs().max()) for n in want) < TOL
    assert max(float((want[n] - torch.eye(want[n].shape[0])).abs().max()) for n in want) > 1e-4  # they trained
    print("OK ddp matches single process")


def main(out: pathlib.Path) -> None:
    rank = dist.get_rank()
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    check_ddp()

    # 1. apply / inspect after fully_shard: refused before anything is touched; the model still trains
    late = shard(tiny.make("tiny-llama").train())
    before = {k: v.full_tensor().clone() for k, v in late.state_dict().items()}
    for call in (lambda: kc.apply(late, LINEAR), lambda: kc.inspect(late)):
        try:
            call()
        except ShardedModelError as e:
            assert "kc.apply(model, ...) first" in str(e) and "FSDP" in str(e), e
        else:
            raise AssertionError("apply after fully_shard was not refused")
    assert not any(".kha." in k for k in late.state_dict())
    losses = [train_step(late, ids, late.parameters()) for _ in range(2)]
    assert losses[1] < losses[0], losses
    moved = max(float((v.full_tensor() - before[k]).abs().max()) for k, v in late.state_dict().items())
    assert moved > 0, "the refused model did not train"
    print("OK refused, still trains")

    # 2. KHA before fully_shard; train the KHA weights; save_pretrained from every rank
    model = shard(kha_model())
    kha_params = [p for n, p in model.named_parameters() if ".kha." in n]
    for _ in range(2):
        train_step(model, ids, kha_params)
    ref = logits(model, ids)
    if rank != 0:  # only rank 0 writes
        import safetensors.torch

        def refuse(*args, **kwargs):
            raise AssertionError("a rank other than 0 wrote the checkpoint")

        safetensors.torch.save_file = refuse
    kc.save_pretrained(model, out / "kha")
    written = sorted(p.name for p in (out / "kha").iterdir())
    assert written == ["kha_config.json", "kha_model.safetensors"], written  # complete once save returns
    if rank == 0:
        fresh = kc.load_pretrained(tiny.make("tiny-llama"), out / "kha")  # single process, not sharded
        assert (logits(fresh, ids) - ref).abs().max() < TOL
        assert (ref - logits(tiny.make("tiny-llama"), ids)).abs().max() > 1e-3  # training moved the logits
    blocker = out / "a_file"  # rank 0 cannot create a directory under a file: every rank hears of it
    if rank == 0:
        blocker.write_text("x")
    dist.barrier()
    try:
        kc.save_pretrained(model, blocker / "kha")
    except kc.errors.CheckpointError as e:
        assert ("cannot create checkpoint directory" if rank == 0 else "rank 0 could not write") in str(e), e
    else:
        raise AssertionError("a failed sharded save was not reported")
    print("OK sharded save -> single-process load")

    # 3. fold on the sharded model: refused, nothing changed
    state = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}
    try:
        kc.fold(model)
    except ShardedModelError as e:
        assert "Gather first" in str(e) and "Nothing was changed" in str(e), e
    else:
        raise AssertionError("fold of a sharded model was not refused")
    after = model.state_dict()
    assert state.keys() == after.keys() and all(torch.equal(state[k], after[k].full_tensor()) for k in state)
    assert (logits(model, ids) - ref).abs().max() == 0
    print("OK fold refused")

    # 4. DCP round trip under FSDP2, then gather, fold in one process: same outputs
    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=str(out / "dcp"))
    other = shard(kha_model())
    target = {"model": get_model_state_dict(other)}
    dcp.load(target, checkpoint_id=str(out / "dcp"))
    set_model_state_dict(other, target["model"])
    assert (logits(other, ids) - ref).abs().max() < TOL
    gathered = full_state(other)  # collective
    if rank == 0:
        plain = kha_model()
        plain.load_state_dict(gathered)
        kc.fold(plain)
        assert not any(".kha." in k for k in plain.state_dict())
        assert (logits(plain, ids) - ref).abs().max() < TOL
    print("OK dcp round trip folds to the same outputs")


if __name__ == "__main__":
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        main(pathlib.Path(sys.argv[1]))
        dist.barrier()  # leave together: a rank tearing gloo down while another still works can abort
    finally:
        dist.destroy_process_group()
