"""Quickstart: knocking-heads attention (KHA) on a tiny Llama.

apply -> inspect -> train 5 steps -> save the KHA weights -> load them into a fresh model.
Random weights, runs in a few seconds on a CPU::

    python examples/quickstart.py
"""

import tempfile

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import kha_compile as kc


def tiny_llama() -> LlamaForCausalLM:
    """A 2-layer Llama (GQA: 4 query heads, 2 key/value heads of size 16), same weights every call."""
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    return LlamaForCausalLM(cfg).eval()


model = tiny_llama()
ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))  # (B, L)
with torch.no_grad():
    before = model(ids).logits

# 1. Insert KHA. The default KHAConfig() is the paper's best (MLP on the values); here a linear
#    transform on the queries as well. For a transformers model the example inputs that the graph
#    pass traces with are built from its config.
kc.apply(model, kc.KHAConfig(q="linear", v="mlp"))
print(kc.inspect(model))  # one row per attention site: kind, heads, rope, which transforms

# Every KHA transform starts at identity: the outputs have not changed.
with torch.no_grad():
    assert torch.equal(model(ids).logits, before)

# 2. Train. Here only the KHA parameters (their names contain "kha"), adapter-style, so the saved
#    checkpoint below fits any copy of the base model. In pre-training you would train everything.
for name, p in model.named_parameters():
    p.requires_grad_("kha" in name)
opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
model.train()
for step in range(5):
    loss = model(ids, labels=ids).loss  # next-token loss on the random batch
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step {step + 1}: loss {loss.item():.4f}")
model.eval()

# 3. Save only the KHA weights and config (a few KB of safetensors + JSON), then re-apply and load
#    them into a fresh copy of the base model.
with tempfile.TemporaryDirectory() as ckpt:
    kc.save_pretrained(model, ckpt)
    fresh = kc.load_pretrained(tiny_llama(), ckpt)
with torch.no_grad():
    assert torch.allclose(fresh(ids).logits, model(ids).logits)
print("saved and loaded: the fresh model reproduces the trained one")
