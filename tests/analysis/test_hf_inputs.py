"""Example inputs for every task head of a transformers model type (kha_compile/analysis/hf_inputs.py).

Every class that transformers' Auto mappings list for BERT, and the Llama, Whisper and wav2vec2
heads whose inputs differ (a sequence classifier without a pad token, log-mel features, raw
audio), gets inputs that run its forward; ``kc.apply`` with no example inputs then puts KHA on
every layer. The multiple-choice head (inputs (batch, choices, sequence)) is checked against the
same weights run as a plain ``BertModel`` on the flattened choices, with KHA applied to that
``BertModel`` through its own inputs: the sites found through the head's trace are the ones the
encoder has.
"""

from __future__ import annotations

import copy

import pytest
import torch

import kha_compile as kc
from helpers import kha_params, perturb
from kha_compile.analysis.hf_inputs import NUM_CHOICES, task_head
from kha_compile.analysis.inputs import example_inputs
from kha_compile.passes.apply import recorded_report
from sweep_configs import shrink_config

transformers = pytest.importorskip("transformers")
from transformers.models.auto import modeling_auto

BERT = dict(vocab_size=96, hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4)


def _heads(model_type: str) -> list[str]:
    """Every class name the Auto mappings give ``model_type`` (one per name)."""
    names: set[str] = set()
    for attr in dir(modeling_auto):
        mapping = getattr(modeling_auto, attr)
        if attr.startswith("MODEL_") and attr.endswith("_MAPPING_NAMES") and isinstance(mapping, dict):
            value = mapping.get(model_type)
            names.update(value if isinstance(value, (list, tuple)) else [value] if value else [])
    return sorted(n for n in names if hasattr(transformers, n))


def _build(name: str, config):
    torch.manual_seed(0)
    return getattr(transformers, name)._from_config(config, attn_implementation="eager").eval()


def test_every_bert_head_in_the_auto_mappings_runs_on_its_example_inputs():
    names = _heads("bert")
    assert {"BertForMultipleChoice", "BertForQuestionAnswering", "BertForMaskedLM", "BertModel"} <= set(names)
    for name in names:
        model = _build(name, transformers.BertConfig(**BERT))
        args, kwargs = example_inputs(model)
        with torch.no_grad():
            model(*args, **kwargs)  # a valid call: the trace of kc.apply runs the same one
        lead = (2, NUM_CHOICES) if name == "BertForMultipleChoice" else (2,)
        assert kwargs["input_ids"].shape == (*lead, 8), name


@pytest.mark.parametrize(
    "model_type, name, main",
    [
        ("llama", "LlamaForSequenceClassification", "input_ids"),  # no pad_token_id: a batch of one
        ("whisper", "WhisperForConditionalGeneration", "input_features"),  # (B, mel bins, frames) + decoder ids
        ("wav2vec2", "Wav2Vec2ForCTC", "input_values"),  # raw audio sized by the conv feature encoder
    ],
)
def test_heads_with_other_inputs_get_kha_on_every_attention(model_type, name, main):
    config = shrink_config(model_type)
    if model_type == "llama":
        config.pad_token_id = None
    model = _build(name, config)
    _, kwargs = example_inputs(model)
    assert main in kwargs
    with torch.no_grad():
        before = model(**kwargs)[0]
    kc.apply(model, kc.KHAConfig(v="linear"))
    report = recorded_report(model)
    # whisper: encoder self-attention, decoder self- and cross-attention
    sites = config.encoder_layers + 2 * config.decoder_layers if model_type == "whisper" else config.num_hidden_layers
    assert len(report.matched) == sites and not report.skipped
    with torch.no_grad():
        assert torch.equal(model(**kwargs)[0], before)  # identity at init


def test_multiple_choice_head_matches_its_encoder_run_on_the_flattened_choices():
    mc = _build("BertForMultipleChoice", transformers.BertConfig(**BERT))
    assert task_head(mc) == "MULTIPLE_CHOICE" and task_head(_build("BertModel", mc.config)) is None
    encoder = copy.deepcopy(mc.bert)
    kc.apply(mc, kc.KHAConfig(q="linear", v="mlp"))  # no example inputs: (batch, choices, sequence) built
    kc.apply(encoder, kc.KHAConfig(q="linear", v="mlp"))  # the encoder alone: (batch, sequence)
    perturb(mc, scale=0.5)
    encoder.load_state_dict({k.removeprefix("bert."): v for k, v in mc.state_dict().items() if k.startswith("bert.")})
    assert set(kha_params(encoder)) == {k.removeprefix("bert.") for k in kha_params(mc)}
    ids = torch.randint(0, 96, (3, 4, 40), generator=torch.Generator().manual_seed(1))  # 3 questions x 4 choices
    with torch.no_grad():
        got = mc(input_ids=ids).logits  # (3, 4)
        hidden = encoder(input_ids=ids.view(-1, 40))  # (12, 40, hidden)
        want = mc.classifier(hidden.pooler_output).view(3, 4)
        plain = copy.deepcopy(mc)
        kc.remove(plain)
        base = plain.bert(input_ids=ids.view(-1, 40)).last_hidden_state
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert (hidden.last_hidden_state - base).abs().max() > 0.05  # the perturbed KHA moves what the choices see
