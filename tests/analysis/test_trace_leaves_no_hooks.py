"""The trace leaves the model as it was (kha_compile/analysis/trace.py, ``leaves_no_trace``).

transformers installs its output-capturing hooks on the first forward that asks for attentions or
hidden states (``config.output_attentions`` / ``output_hidden_states``, as transformers' own model
tests set them) and never again. Traced with one block per type, that first forward ran on the
cut-down layer list, and the model returned one attention and one hidden state fewer ever after.
The reference is an untouched copy of the same model (eager attention) with the same config.
"""

from __future__ import annotations

import copy

import pytest
import torch

import kha_compile as kc

transformers = pytest.importorskip("transformers")

IDS = torch.randint(0, 96, (2, 7), generator=torch.Generator().manual_seed(0))


def _model(cls, config):
    torch.manual_seed(0)
    return cls._from_config(config, attn_implementation="eager").eval()


@pytest.mark.parametrize("arch", ["llama", "bert"])
def test_outputs_of_every_layer_after_inspect_and_apply_with_the_config_flags_set(arch):
    if arch == "llama":
        cls, config = transformers.LlamaForCausalLM, transformers.LlamaConfig(
            vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2,
        )  # fmt: skip
    else:
        cls, config = (
            transformers.BertForMaskedLM,
            transformers.BertConfig(
                vocab_size=96, hidden_size=32, intermediate_size=37, num_hidden_layers=3, num_attention_heads=4
            ),
        )
    config.output_attentions = config.output_hidden_states = True
    model = _model(cls, config)
    untouched = copy.deepcopy(model)
    kc.inspect(model)
    kc.apply(model, kc.KHAConfig(q="linear", k="linear", v="mlp"))
    with torch.no_grad():
        got, want = model(IDS), untouched(IDS)
        explicit = model(IDS, output_attentions=True, output_hidden_states=True)
    assert len(want.attentions) == 3 and len(want.hidden_states) == 4
    for out in (got, explicit):
        assert len(out.attentions) == len(want.attentions) and len(out.hidden_states) == len(want.hidden_states)
        for a, b in zip(out.attentions + out.hidden_states, want.attentions + want.hidden_states):
            assert torch.equal(a, b)
