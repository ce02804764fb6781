"""KHA in a hand-written model: interleaved fused QKV, rotary embeddings, no transformers.

The graph pass finds the attention in any nn.Module: it anchors on scaled_dot_product_attention and
walks q, k and v back through the rotary embedding and the head split to the one fused projection,
whose output features are laid out per head as [H, 3, Dh] (GPT-NeoX style). For a plain nn.Module
the example inputs are required::

    python examples/custom_attention.py
"""

import torch
import torch.nn.functional as F
from torch import nn

import kha_compile as kc


def rope(x: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding, rotate-half form. x: (B, H, L, Dh)."""
    L, Dh = x.shape[-2], x.shape[-1]
    inv_freq = 1.0 / (10000 ** (torch.arange(0, Dh, 2, dtype=torch.float32) / Dh))  # (Dh/2,)
    angles = torch.outer(torch.arange(L, dtype=torch.float32), inv_freq)  # (L, Dh/2)
    cos, sin = angles.cos().repeat(1, 2), angles.sin().repeat(1, 2)  # (L, Dh)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, d: int = 64, n_head: int = 4):
        super().__init__()
        self.n_head, self.dh = n_head, d // n_head
        self.qkv = nn.Linear(d, 3 * d)  # one fused projection, features interleaved per head: [H, 3, Dh]
        self.out = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, L, D = x.shape
        qkv = self.qkv(x).view(B, L, self.n_head, 3, self.dh)  # (B, L, H, 3, Dh)
        q, k, v = qkv.permute(3, 0, 2, 1, 4)  # 3 x (B, H, L, Dh)
        q, k = rope(q), rope(k)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, L, Dh)
        return self.out(y.transpose(1, 2).reshape(B, L, D))  # (B, L, D)


class Block(nn.Module):
    def __init__(self, d: int = 64):
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(d), Attention(d)
        self.norm2, self.mlp = nn.LayerNorm(d), nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


torch.manual_seed(0)
model = nn.Sequential(Block(), Block()).eval()
x = torch.randn(2, 10, 64)  # (B, L, D)
with torch.no_grad():
    reference = model(x)

# Without example inputs a plain nn.Module cannot be traced: the error says what to pass.
try:
    kc.apply(model, kc.KHAConfig(v="linear"))
except kc.KHAError as e:
    print(f"as expected: {type(e).__name__}: {str(e)[:90]}...")

# Linear KHA on all three roles; example_args make one valid call of the model.
kc.apply(model, kc.KHAConfig(q="linear", k="linear", v="linear"), example_args=(x,))
report = kc.inspect(model, example_args=(x,))
print(report)
assert len(report.matched) == 2 and all(s.rope for s in report.matched)
with torch.no_grad():
    assert torch.equal(model(x), reference)  # identity at init

# Stand-in for training: move every T away from identity.
with torch.no_grad():
    for name, p in model.named_parameters():
        if "kha" in name:
            p.add_(0.1 * torch.randn_like(p))
    trained = model(x)
assert not torch.allclose(trained, reference)

# Fold: T^Q, T^K, T^V go into the right rows of each head's block of the fused qkv weight,
# before the rotary embedding (KHA sits right after the head split). The model is vanilla again.
kc.fold(model)
assert type(model[0].attn.qkv) is nn.Linear
with torch.no_grad():
    folded = model(x)
print(f"folded vs trained: max |diff| = {(folded - trained).abs().max():.1e}")
assert torch.allclose(folded, trained, atol=1e-5)
