"""Small helpers shared by the test files."""

from __future__ import annotations

import torch
from torch import nn

import zoo
from reference import Reference, main_tensor


def main_output(out):
    """The tensor a model's forward is about: logits, last hidden state, or the output itself."""
    if isinstance(out, dict) and "sentence_embedding" in out:
        return out["sentence_embedding"]
    for attr in ("logits", "last_hidden_state"):
        if getattr(out, attr, None) is not None:
            return getattr(out, attr)
    if isinstance(out, (tuple, list)):
        return out[0]
    return out


def run(case: zoo.ZooCase) -> torch.Tensor:
    """The case's main output. Grad mode is left to the caller: nn.TransformerEncoderLayer's fused
    no-grad fast path rounds differently from its regular path, so compare like with like."""
    return main_output(case())


def kha_params(model: nn.Module) -> dict[str, nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if ".kha." in f".{n}"}


def perturb(model: nn.Module, seed: int = 1, scale: float = 0.1) -> None:
    """Move every KHA weight off its identity init, as training would; fails when there is none to move."""
    params = kha_params(model)
    assert params, f"{type(model).__name__} has no KHA parameters to perturb"
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in params.items():
            before = p.detach().clone()
            p.add_(scale * torch.randn(p.shape, generator=gen).to(p.dtype))
            assert p.is_meta or not torch.equal(p, before), f"perturbing {name} changed nothing"


# the layout tests/reference.py writes out for each zoo model (transformers models: their config's model_type)
REFERENCE_ARCH = {"torch_encoder": "torch_mha", "nanogpt": "nanogpt"}


def expected_roles(case: zoo.ZooCase, cfg) -> dict[str, str]:
    """Role -> kind every projection of ``case`` carries after ``kc.apply(model, cfg)``.

    MLA sites take linear where MLP-value is asked for (docs/method.md, "Multi-head latent attention").
    """
    roles = dict(cfg.roles())
    if "mla" in case.kinds and roles.get("v") == "mlp":
        roles["v"] = "linear"
    return roles


def zoo_reference(name: str, untouched: nn.Module) -> Reference:
    """The per-head reference (tests/reference.py) of zoo model ``name`` over its untouched copy."""
    return Reference(untouched, REFERENCE_ARCH.get(name))


def reference_output(
    name: str,
    model: nn.Module,
    args: tuple,
    kwargs: dict,
    expect=None,
    dtype: torch.dtype | None = None,
    state: dict[str, torch.Tensor] | None = None,
) -> torch.Tensor:
    """The main output of ``model`` (zoo model ``name`` with KHA) as the per-head reference computes it.

    The reference is a fresh untouched ``zoo.make(name)`` with ``model``'s weights and KHA tensors loaded
    by name; it shares no code with kha_compile (no fold, no head slots, no strategy). ``dtype``: compute
    it in this dtype (weights and float inputs cast), e.g. float32 for a bfloat16 model. ``state``: the
    weights to use instead of ``model.state_dict()``.
    """
    dtype = dtype or next(model.parameters()).dtype
    untouched = zoo.make(name, dtype=dtype).model
    state = model.state_dict() if state is None else state
    state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    ref = zoo_reference(name, untouched).load(state, expect)

    def cast(x):
        return x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x

    return main_tensor(ref(*(cast(a) for a in args), **{k: cast(v) for k, v in kwargs.items()})).detach()


def perturb_biases(model: nn.Module, seed: int = 3, scale: float = 0.1) -> int:
    """Move every bias off its init (transformers initialises them to zero; training would not leave them there).

    A fold that forgets the bias is exact at a zero bias: tests of folds perturb biases too. Returns how many moved.
    """
    gen = torch.Generator().manual_seed(seed)
    moved = 0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.rsplit(".", 1)[-1] in ("bias", "in_proj_bias") and ".kha." not in f".{name}":
                p.add_(scale * torch.randn(p.shape, generator=gen).to(p.dtype))
                moved += 1
    return moved


def run_python(script: str, expect: str, timeout: int = 300) -> str:
    """Run ``script`` in a fresh interpreter; it must exit 0 and print ``expect``. Returns its stdout."""
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0 and expect in res.stdout, res.stderr[-2000:]
    return res.stdout


def run_outside_repo(script: str, *args: str, cwd, timeout: int = 300) -> str:
    """Run ``script`` with ``args`` in a fresh interpreter started in ``cwd`` (not the repository, so kha_compile is
    not on its path), with only PATH, one OpenMP thread and AOTInductor's input checks in its environment; it
    must exit 0. Returns its stdout."""
    import os
    import subprocess
    import sys

    env = {"PATH": os.environ["PATH"], "OMP_NUM_THREADS": "1", "AOTI_RUNTIME_CHECK_INPUTS": "1"}  # no PYTHONPATH
    res = subprocess.run(
        [sys.executable, "-c", script, *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout


# The start of a script run where kha_compile cannot be imported (what a user without it has); it
# records transformers' log records in ``seen`` as (level name, message).
WITHOUT_KHA = """
import logging, sys
sys.modules["kha_compile"] = None  # kha_compile cannot be imported in this process
try:
    import kha_compile
    raise SystemExit("kha_compile importable")
except ImportError:
    pass
import transformers
seen = []
class Keep(logging.Handler):
    def emit(self, record):
        seen.append((record.levelname, record.getMessage()))
transformers.logging.get_logger().addHandler(Keep())
"""


def run_python_without_kha(script: str, expect: str, timeout: int = 300) -> str:
    """:func:`run_python` of :data:`WITHOUT_KHA` followed by ``script`` (which reads ``seen``)."""
    return run_python(WITHOUT_KHA + script, expect, timeout)


# Issue 9's FLOP shape: a Llama with hidden 1024, 8 q / 4 kv heads of 128, 2 layers, batch 4 x seq 2048.
META_LLAMA = dict(
    hidden_size=1024,
    intermediate_size=2816,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=128,
    vocab_size=8192,
)
META_BATCH, META_SEQ = 4, 2048


def meta_llama() -> nn.Module:
    """The META_LLAMA model on the meta device (no memory, no compute)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        return LlamaForCausalLM(LlamaConfig(**META_LLAMA))


def training_step_flops(model: nn.Module) -> int:
    """FLOPs of one forward + backward of a META_LLAMA-shaped model, counted by FlopCounterMode on meta."""
    from torch.utils.flop_counter import FlopCounterMode

    ids = torch.zeros(META_BATCH, META_SEQ, dtype=torch.long, device="meta")
    mask = torch.zeros(META_BATCH, 1, META_SEQ, META_SEQ, device="meta")  # explicit 4-D mask: no .item() on meta
    with FlopCounterMode(display=False) as fc:
        model(input_ids=ids, attention_mask=mask, use_cache=False).logits.sum().backward()
    return fc.get_total_flops()


def small_trainer(model: nn.Module, out, max_steps: int, vocab: int, seq: int):
    """A transformers Trainer on 16 random sequences: constant learning rate, a checkpoint every 2 steps,
    CPU, seeded (two runs with the same arguments train the same)."""
    import transformers

    gen = torch.Generator().manual_seed(0)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, vocab, (16, seq), generator=gen)]
    args = transformers.TrainingArguments(
        str(out),
        max_steps=max_steps,
        save_steps=2,
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        report_to=[],
        use_cpu=True,
        seed=0,
        data_seed=0,
        logging_strategy="no",
        lr_scheduler_type="constant",
    )
    return transformers.Trainer(model=model, args=args, train_dataset=data)
