"""Quantized KHA models in the real vLLM (CPU build): compressed-tensors W8A8 int8, the method vLLM's CPU
build runs in float32 (its int8 GEMM), checked token by token and log-probability by log-probability.

Two ways to deploy a quantized KHA model, each on a tiny Llama with trained-like (perturbed) KHA:

- linear KHA folded (``kc.fold``), then quantized: a vanilla compressed-tensors directory vLLM serves alone;
- MLP-value KHA on a quantized base: the base quantized, its KHA saved beside it (``kc.save_pretrained``),
  which records kha_compile's quantization method around compressed-tensors'; the plugin runs the KHA on
  the output of compressed-tensors' int8 QKV projection.

The quantization runs in the vLLM environment (compressed-tensors, tests/serving/vllm/serve_quantize.py), in
the same process as the serving: quantize both, save the trained KHA beside the quantized base (``kc.save_pretrained``
there, of the directory this environment saved), then serve.
Two references, both from this environment's transformers on the same model object: the model without
quantization (vLLM must stay within the quantization error of it), and the same model with the quantized
directory's int8 weights times their scales and each quantized layer's input rounded to int8 per token,
as W8A8 computes (vLLM must agree with it to float rounding: that is what shows its KHA is the trained one).
A plugin that drops the MLP-value KHA (patched in the worker) must fail that comparison.
"""

from __future__ import annotations

import copy
import json
import pathlib
import shutil
import statistics

import pytest
import torch
import vllm_env
from safetensors.torch import load_file
from serve_greedy import NEW_TOKENS
from serve_models import BLOCK, PROMPTS, Case, build, greedy, write_config_entry

import kha_compile as kc

pytestmark = pytest.mark.slow

LINEAR = kc.KHAConfig(q="linear", k="linear", v="linear")
MLP = kc.KHAConfig(v="mlp")
# vLLM's int8 GEMM against the same W8A8 arithmetic in float32 agrees to float rounding (1e-6) up to the first
# input that sits on a rounding boundary of int8, which the two engines round to neighbouring integers; the
# tokens after it attend to it and move by a small fraction of the quantization error (measured: median
# 3e-4 nats, at most 0.06, where the quantization error is median 0.05 and up to 0.6, and dropping the KHA 1.6)
CLOSE = 1e-3  # the median gap to W8A8 in transformers
FLIPS = 0.1  # the largest gap to W8A8 in transformers
TIE = 0.1  # greedy tokens are compared where the W8A8 reference's two best logits are further apart


def _fake_int8(module: torch.nn.Module, args: tuple) -> tuple:
    """W8A8's dynamic activation quantization: each token's input rounded to int8 at its own absmax / 127."""
    (x,) = args
    scale = x.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 127
    return ((x / scale).round().clamp(-128, 127) * scale,)


def w8a8_reference(model: torch.nn.Module, directory: pathlib.Path, quantized: list[str]) -> torch.nn.Module:
    """``model`` computing as W8A8 does: ``directory``'s int8 weights times their per-row scales, inputs per token."""
    ref = copy.deepcopy(model).eval()
    weights = load_file(str(directory / "model.safetensors"))
    modules = dict(ref.named_modules())
    for name in quantized:
        q, scale = weights[f"{name}.weight"], weights[f"{name}.weight_scale"]
        assert q.dtype == torch.int8, (name, q.dtype)
        with torch.no_grad():
            modules[name].weight.copy_(q.float() * scale)
        modules[name].register_forward_pre_hook(_fake_int8)
    return ref


def prompt_logprobs(model: torch.nn.Module) -> list[list[float]]:
    """log p(token t | tokens before it) for every prompt token after the first (teacher forcing)."""
    out = []
    with torch.no_grad():
        for p in PROMPTS:
            logp = model(torch.tensor([p])).logits[0].float().log_softmax(-1)
            out.append([logp[i, t].item() for i, t in enumerate(p[1:])])
    return out


def _gaps(a: list[list[float]], b: list[list[float]]) -> list[float]:
    return [abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb)]


def _tokens_differ(reference: list[dict[str, list]], got: list[list[int]]) -> tuple[list[str], int]:
    """Where ``got`` departs from the reference's greedy tokens, comparing each prompt up to its first near-tie."""
    problems, compared = [], 0
    for i, (ref, tokens) in enumerate(zip(reference, got)):
        for j, (want, have) in enumerate(zip(ref["tokens"], tokens)):
            if ref["margins"][j] < TIE:
                break
            if want != have:
                problems.append(f"prompt {i}: token {j} is {have}, the reference gives {want}")
                break
            compared += 1
    return problems, compared


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(the root folder, the references, vLLM's results): both directories quantized and served."""
    root = tmp_path_factory.mktemp("quantized")
    _, folded = build(Case("folded", "llama", LINEAR, save="folded", seed=21), root)
    base_dir, kha_model = build(Case("mlp", "llama", MLP, save="kc", seed=22), root)  # base files, then KHA
    # the base alone is what gets quantized; the trained KHA (kc.save_pretrained's files) moves beside it
    (root / "mlp-kha").mkdir()
    for name in ("kha_config.json", "kha_model.safetensors"):
        shutil.move(base_dir / name, root / "mlp-kha" / name)
    write_config_entry(base_dir, kha_compile=None, quantization_config=None)
    jobs = [
        dict(name=f"quantize-{n}", kind="quantize", model=str(root / n), out=str(root / f"{n}-w8a8"), scheme="W8A8")
        for n in ("folded", "mlp")
    ]
    # the trained KHA beside the quantized base
    jobs.append(
        dict(
            name="kha-save", kind="kha_save", model=str(base_dir), kha=str(root / "mlp-kha"), out=str(root / "mlp-w8a8")
        )
    )
    generate = [
        dict(name=n, kind="generate", model=str(root / f"{n}-w8a8"), prompts=PROMPTS, new_tokens=NEW_TOKENS,
             block_size=BLOCK, logprobs=True)
        for n in ("folded", "mlp")
    ]  # fmt: skip
    jobs += [*generate, dict(generate[1], name="mlp-broken", **{"break": "v"})]
    results = vllm_env.run_jobs(jobs, root)
    for name in ("quantize-folded", "quantize-mlp", "kha-save"):
        assert "crash" not in results[name], results[name]["crash"]
    refs = {
        "folded": (folded, w8a8_reference(folded, root / "folded-w8a8", results["quantize-folded"]["quantized"])),
        "mlp": (kha_model, w8a8_reference(kha_model, root / "mlp-w8a8", results["quantize-mlp"]["quantized"])),
    }
    return root, refs, results


def _check(served, name: str, method: str) -> None:
    _, refs, results = served
    res = results[name]
    assert "crash" not in res, f"{name}: the vLLM job failed:\n{res['crash']}"
    assert res["quantization"] == method, res["quantization"]
    model, w8a8 = refs[name]
    same = _gaps(res["logprobs"], prompt_logprobs(w8a8))  # vLLM against W8A8 in transformers
    error = _gaps(prompt_logprobs(w8a8), prompt_logprobs(model))  # the quantization error itself
    off = _gaps(res["logprobs"], prompt_logprobs(model))  # vLLM against the float model
    assert statistics.median(same) < CLOSE, f"{name}: vLLM differs from W8A8 by {statistics.median(same):.3g} (median)"
    assert max(same) < FLIPS, f"{name}: vLLM's log-probabilities differ from W8A8 by up to {max(same):.3g}"
    assert max(off) < max(error) + FLIPS, f"{name}: vLLM is {max(off):.3g} nats from the float model"
    assert statistics.median(error) > 20 * statistics.median(same), f"{name}: the quantization changed nothing"
    problems, compared = _tokens_differ(greedy(w8a8, PROMPTS), res["tokens"])
    assert not problems, f"{name}: vLLM's greedy tokens differ from W8A8 in transformers: {problems}"
    assert compared >= NEW_TOKENS, f"{name}: only {compared} tokens compared (near-ties)"


def test_folded_then_quantized_is_served_by_vllm_alone(served):
    root, _, results = served
    config = json.loads((root / "folded-w8a8" / "config.json").read_text())
    assert "kha_compile" not in config and config["quantization_config"]["quant_method"] == "compressed-tensors"
    assert results["quantize-folded"]["format"] == "int-quantized"
    _check(served, "folded", "compressed-tensors")


def test_mlp_value_kha_runs_around_compressed_tensors_in_vllm(served):
    root, refs, results = served
    quant = json.loads((root / "mlp-w8a8" / "config.json").read_text())["quantization_config"]
    assert quant["quant_method"] == "kha_compile" and quant["v"] == "mlp"
    assert quant["wraps"]["quant_method"] == "compressed-tensors" and quant["wraps"]["format"] == "int-quantized"
    _check(served, "mlp", "kha_compile")
    broken = results["mlp-broken"]  # the same, with the plugin's MLP-value KHA dropped
    assert "crash" not in broken, broken["crash"]
    gap = statistics.median(_gaps(broken["logprobs"], prompt_logprobs(refs["mlp"][1])))
    assert gap > 100 * CLOSE, f"a plugin without the MLP-value KHA still matched W8A8 with KHA ({gap:.3g})"
