"""Ship MLP-value KHA: one custom ONNX node per attention, run by onnxruntime.

MLP-value KHA (the paper's best) is not linear, so it does not fold: it stays the op
``torch.ops.kha.mlp_value`` and export_onnx writes it as one ``kha::MLPValue`` node per attention.
The file also carries a function of the same name with its decomposition (MatMul, Sigmoid, Mul),
so onnxruntime runs it as it is; TensorRT maps the node to the fused plugin instead
(``kc.export_tensorrt``, on an NVIDIA GPU)::

    python examples/deploy_mlp_value.py [OUT.onnx]

Needs the hf and onnx extras: pip install 'kha-compile[hf,onnx]'.
"""

import pathlib
import sys

import onnx
import onnxruntime as ort
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

import kha_compile as kc
from kha_compile.exporters import onnx_summary

path = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "qwen3_kha_mlp.onnx")

# A tiny Qwen3 (GQA with per-head q/k RMSNorm) with random weights; any model works the same way.
torch.manual_seed(0)
cfg = Qwen3Config(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
)
model = Qwen3ForCausalLM(cfg).eval()

kc.apply(model, kc.KHAConfig(v="mlp"))  # v~ = 2 ((v W_up) * sigmoid(v W_gate)) W_down, per kv head
with torch.no_grad():  # stand-in for training: move W_up, W_gate, W_down off init
    for name, p in model.named_parameters():
        if ".kha." in name:
            p.add_(0.05 * torch.randn_like(p))

# Export with dynamic batch and sequence axes (example inputs built from the config).
path.parent.mkdir(parents=True, exist_ok=True)
kc.export_onnx(model, path)
summary = onnx_summary(path)
print(summary)  # node counts, the custom nodes, inputs and outputs
node = next(n for n in onnx.load(str(path), load_external_data=False).graph.node if n.domain == "kha")
print(
    f"custom node: {node.domain}::{node.op_type}, attributes { {a.name: a.s.decode() for a in node.attribute} }"
)  # plugin_namespace / plugin_version for TensorRT
assert summary.num_custom_nodes == cfg.num_hidden_layers

# Run in onnxruntime on a batch and length other than the export's, and compare with torch.
ids = torch.randint(0, cfg.vocab_size, (3, 21))  # (B, L)
mask = torch.ones_like(ids)
session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
feed = {"input_ids": ids.numpy(), "attention_mask": mask.numpy()}
logits = torch.from_numpy(session.run(None, {i.name: feed[i.name] for i in session.get_inputs()})[0])
with torch.no_grad():
    expected = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
print(f"onnxruntime vs torch on (3, 21): max |diff| = {(logits - expected).abs().max():.1e}")
assert torch.allclose(logits, expected, atol=1e-4)
