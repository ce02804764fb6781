"""LoRA + KHA on a tiny Llama: train both, then merge and fold into a vanilla model.

KHA transforms the whole projection output, LoRA's delta included: ``T(Wx + BAx)``. Either order
of ``kc.apply`` and ``get_peft_model`` gives that; this script uses LoRA first. Random weights,
runs in a few seconds on a CPU::

    python examples/lora_kha.py
"""

import copy
import tempfile

import torch
from peft import LoraConfig, get_peft_model

import kha_compile as kc
from kha_compile.cli import tiny

model = tiny.make("tiny-llama")  # LlamaForCausalLM, 4 query / 2 kv heads of size 16
ids = torch.randint(0, tiny.VOCAB, (4, 16), generator=torch.Generator().manual_seed(1))  # (B, L)

# 1. LoRA on q and v, then KHA on the PEFT model (no example inputs needed: built from the config).
#    kc.apply(model) first and get_peft_model(...) second works too; then call
#    kc.mark_trainable(peft_model), because get_peft_model freezes everything that is not LoRA.
peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
kc.apply(peft_model, kc.KHAConfig(q="linear", v="linear"))
trainable = [n for n, p in peft_model.named_parameters() if p.requires_grad]
print(f"trainable tensors: {sum('lora_' in n for n in trainable)} LoRA, {sum('.kha.' in n for n in trainable)} KHA")

# 2. Train both kinds of parameters together.
opt = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=1e-2)
peft_model.train()
for step in range(10):
    loss = peft_model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    if step % 3 == 0:
        print(f"step {step}: loss {loss.item():.4f}")
peft_model.eval()
with torch.no_grad():
    want = peft_model(input_ids=ids).logits

# 3. The KHA weights alone, under canonical names (no base_model.model. / base_layer).
with tempfile.TemporaryDirectory() as d:
    kc.save_pretrained(peft_model, d)

# 4. Merge LoRA and fold KHA, in either order: the same vanilla LlamaForCausalLM.
a = kc.fold(copy.deepcopy(peft_model).merge_and_unload())
b = kc.fold(copy.deepcopy(peft_model)).merge_and_unload()
with torch.no_grad():
    for name, vanilla in (("merge then fold", a), ("fold then merge", b)):
        diff = (vanilla(input_ids=ids).logits - want).abs().max().item()
        print(
            f"{name}: {type(vanilla.model.layers[0].self_attn.q_proj).__name__} projections, "
            f"max |logits - trained| = {diff:.1e}"
        )
        assert diff < 1e-4
