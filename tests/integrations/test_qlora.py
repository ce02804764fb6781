"""The QLoRA recipe with KHA, end to end with the real libraries: a tiny random Llama loaded in 4-bit
(bitsandbytes' CPU backend), ``kc.apply``, PEFT's ``prepare_model_for_kbit_training`` and LoRA, a few
``Trainer`` steps (its default optimizer), then ``save_pretrained`` and ``from_pretrained`` by path.

References: the 4-bit weights themselves (they must not move), the KHA and LoRA tensors before training
(both must move), the loss of the first step (the last must be lower), and for the reload the same base
saved and reloaded without KHA, with the trained KHA tensors put in by hand: loading by path must give
its logits exactly, with the quantization (4-bit weights) and the KHA (the trained values).
"""

from __future__ import annotations

import json

import pytest
import torch

import kha_compile as kc
from quantized_bases import save_tiny_llama

pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed (the quant extra)")
peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

CFG = kc.KHAConfig(v="mlp")
IDS = torch.randint(0, 128, (4, 48), generator=torch.Generator().manual_seed(0))


def _load_4bit(path):
    qc = transformers.BitsAndBytesConfig(load_in_4bit=True)
    return transformers.AutoModelForCausalLM.from_pretrained(path, quantization_config=qc)


class _Batches(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return len(IDS)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": IDS[i], "labels": IDS[i]}


def _qlora(path, out):
    model = _load_4bit(path)
    kc.apply(model, CFG)
    model = peft.prepare_model_for_kbit_training(model)
    tuned = peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    kc.mark_trainable(tuned)  # get_peft_model froze the KHA parameters
    return tuned


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("qlora")
    path = save_tiny_llama(root / "base")
    tuned = _qlora(path, root)
    before = {n: p.detach().clone() for n, p in tuned.named_parameters()}
    packed = {n: p.detach().clone() for n, p in tuned.named_parameters() if p.dtype == torch.uint8}
    args = transformers.TrainingArguments(
        output_dir=str(root / "run"), max_steps=12, per_device_train_batch_size=4, learning_rate=1e-2,
        logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=0,
    )  # fmt: skip
    trainer = transformers.Trainer(model=tuned, args=args, train_dataset=_Batches())
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return root, path, tuned, before, packed, losses, getattr(args.optim, "value", args.optim)


def test_qlora_trains_kha_and_lora_and_leaves_the_4bit_weights(trained):
    _, _, tuned, before, packed, losses, optim = trained
    assert optim == "adamw_torch_fused", optim  # the Trainer's default optimizer
    moved = {n for n, p in tuned.named_parameters() if p.requires_grad and not torch.equal(p, before[n])}
    kha = {n for n, p in tuned.named_parameters() if ".kha." in n}
    lora = {n for n, p in tuned.named_parameters() if ".lora_" in n}
    assert kha and kha <= moved, f"KHA tensors that did not train: {sorted(kha - moved)[:3]}"
    assert lora and {n for n in lora if "lora_B" in n} <= moved, "LoRA did not train"
    assert moved <= kha | lora, f"other tensors moved: {sorted(moved - kha - lora)[:3]}"
    assert packed, "no 4-bit weights: the base is not quantized"
    for n, p in tuned.named_parameters():
        if n in packed:
            assert torch.equal(p, packed[n]), f"the 4-bit weight {n} changed"
    assert losses[-1] < losses[0] - 0.1, f"the loss did not go down: {losses}"  # random tokens: slowly


def test_a_qlora_model_saved_and_loaded_by_path_keeps_its_quantization_and_kha(trained):
    root, path, tuned, *_ = trained
    tuned.save_pretrained(root / "adapter")  # PEFT: the LoRA adapter only
    kha = {n.replace("base_model.model.", ""): p.detach().clone() for n, p in tuned.named_parameters() if ".kha." in n}
    base = tuned.unload()  # the 4-bit KHA base without LoRA
    base.save_pretrained(root / "kha-4bit")
    quant = json.loads((root / "kha-4bit" / "config.json").read_text())["quantization_config"]
    assert quant["quant_method"] == "kha_compile" and quant["wraps"]["quant_method"] == "bitsandbytes"
    assert quant["wraps"]["load_in_4bit"] is True

    loaded = transformers.AutoModelForCausalLM.from_pretrained(root / "kha-4bit")  # by path alone
    layer = loaded.model.layers[0].self_attn.v_proj
    assert type(layer.weight).__name__ == "Params4bit" and layer.weight.dtype == torch.uint8
    assert loaded.is_loaded_in_4bit and type(loaded.config.quantization_config).__name__ == "BitsAndBytesConfig"
    got = {n: p for n, p in loaded.named_parameters() if ".kha." in n}
    assert got.keys() == kha.keys() and all(torch.equal(got[n], kha[n]) for n in kha)

    # the reference: the same 4-bit base saved and loaded without KHA, the trained KHA put in by hand
    plain = _load_4bit(path)
    plain.save_pretrained(root / "plain-4bit")
    ref = transformers.AutoModelForCausalLM.from_pretrained(root / "plain-4bit")
    kc.apply(ref, CFG)
    ref.load_state_dict(kha, strict=False)
    with torch.no_grad():
        want, have = ref(IDS).logits, loaded(IDS).logits
        assert torch.equal(have, want)
        lora_model = peft.PeftModel.from_pretrained(loaded, root / "adapter")  # and the adapter on top
        assert not torch.equal(lora_model(IDS).logits, want)  # LoRA's trained delta is back
