"""kc.export_aoti(generation=True): a .pt2 package that generates over a static KV cache held inside it, run
from Python (with and without kha_compile) and from the C++ runner of examples/aoti_cpp, against
transformers' ``generate`` on the KHA model.

One package is built for the module (an AOTInductor compile: 20-60 s on two busy cores): a Qwen3-style
model (GQA, q/k RMSNorm before RoPE) with linear KHA on q and k (folded into the package) and MLP-value
KHA on v (lowered inside it), perturbed; a cache of 32 positions for up to 2 sequences.
"""

from __future__ import annotations

import os
import subprocess

import pytest
import torch

import kha_compile as kc
import zoo
from helpers import perturb, run_outside_repo
from kha_compile.core.errors import CacheOverflowError, ExportError, NoKVCacheError
from kha_compile.exporters import generate, generate_aoti, read_aoti_metadata

pytest.importorskip("transformers")

MAX_LEN, MAX_BATCH, NEW = 32, 2, 10
PROMPTS = [torch.tensor([[5, 17, 33, 9, 100]]), torch.tensor([[3, 4, 5, 6, 7, 8], [90, 80, 70, 60, 50, 40]])]

# A fresh interpreter that cannot import kha_compile: loads the package and generates greedily, as a user
# without the library would (prefill, then one token per call at the next position).
FRESH = r"""
import sys
sys.modules["kha_compile"] = None
import torch
data = torch.load(sys.argv[2])
runner = torch._inductor.aoti_load_package(sys.argv[1])
for prompt, want in zip(data["prompts"], data["want"]):
    tokens, s = prompt, prompt.shape[1]
    logits = runner(prompt, torch.arange(s))
    for t in range(want.shape[1] - s):
        nxt = logits[:, -1].argmax(-1, keepdim=True)
        tokens = torch.cat([tokens, nxt], 1)
        logits = runner(nxt, torch.tensor([s + t]))
    print("equal", bool(torch.equal(tokens, want)))
assert "transformers" not in sys.modules
"""


def _hf_generate(model, prompt: torch.Tensor, new: int = NEW) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new, do_sample=False)


@pytest.fixture(scope="module")
def package(tmp_path_factory):
    model = zoo.make("qwen3").model  # names no eos: generate and the package both run NEW tokens
    kc.apply(model, kc.KHAConfig(q="linear", k="linear", v="mlp"))
    perturb(model)
    path = kc.export_aoti(
        model, tmp_path_factory.mktemp("gen") / "gen.pt2", generation=True, max_batch=MAX_BATCH, max_cache_len=MAX_LEN
    )
    return model, path, torch._inductor.aoti_load_package(str(path))


def test_generates_what_transformers_generates_prompt_after_prompt(package):
    """Several prompts through one loaded package: a new prompt overwrites the cache from position 0."""
    model, path, runner = package
    for prompt in [*PROMPTS, PROMPTS[0]]:
        assert generate_aoti(path, prompt, NEW, runner=runner).tolist() == _hf_generate(model, prompt).tolist()


def test_the_tokens_depend_on_the_kha_weights(package):
    model, _, _ = package
    assert _hf_generate(zoo.make("qwen3").model, PROMPTS[1]).tolist() != _hf_generate(model, PROMPTS[1]).tolist()


def test_runs_where_kha_compile_cannot_be_imported(package, tmp_path):
    model, path, _ = package
    torch.save({"prompts": PROMPTS, "want": [_hf_generate(model, p) for p in PROMPTS]}, tmp_path / "ref.pt")
    stdout = run_outside_repo(FRESH, str(path), str(tmp_path / "ref.pt"), cwd=tmp_path)
    assert stdout.split() == ["equal", "True"] * len(PROMPTS)


def test_metadata_names_the_inputs_and_the_cache(package):
    _, path, runner = package
    meta = read_aoti_metadata(path)
    assert meta["input_names"] == ["input_ids", "cache_position"] and meta["output_names"] == ["logits"]
    assert meta["cache"] == {
        "kind": "static",
        "max_cache_len": MAX_LEN,
        "max_batch": MAX_BATCH,
        "num_layers": 2,
        "num_kv_heads": 2,
        "head_size": zoo.HEAD_DIM,
        "dtype": "float32",
    }
    assert meta["dynamic_shapes"] == {
        "input_ids": {"0": [1, MAX_BATCH], "1": [1, MAX_LEN]},
        "cache_position": {"0": [1, MAX_LEN]},
    }
    assert meta["config"] == {**meta["config"], "q": "linear", "k": "linear", "v": "mlp"} and meta["folded"] is True
    constants = runner.get_constant_fqns()
    assert sum(".kha." in n for n in constants) == 2 * 3  # MLP-value: up, gate, down per layer; q, k folded
    assert sum("key_cache" in n or "value_cache" in n for n in constants) == 2 * 2  # the cache, inside


def test_a_call_beyond_the_cache_is_refused_and_loses_nothing(package):
    model, path, runner = package
    prompt = PROMPTS[0]
    with pytest.raises(CacheOverflowError, match=r"need 1 x 33 cache positions; the package .* holds 2 x 32"):
        generate_aoti(path, prompt, MAX_LEN - prompt.shape[1] + 2, runner=runner)
    with pytest.raises(CacheOverflowError, match=r"3 prompt\(s\) .* holds 2 x 32"):
        generate_aoti(path, prompt.repeat(3, 1), 2, runner=runner)
    longest = MAX_LEN - prompt.shape[1] + 1  # the last new token is never written to the cache
    want = _hf_generate(model, prompt, longest)
    assert generate_aoti(path, prompt, longest, runner=runner).tolist() == want.tolist()


def test_the_package_itself_stops_outside_its_cache(package):
    """Called directly past its cache, the package raises (Inductor's bounds check), it does not write there."""
    _, _, runner = package
    with pytest.raises(RuntimeError, match="index out of bounds"):
        runner(torch.tensor([[1]]), torch.tensor([MAX_LEN]))


def test_a_package_without_a_cache_is_not_generated_from(monkeypatch, package):
    monkeypatch.setattr(generate, "read_aoti_metadata", lambda path: {"format": "aoti"})
    with pytest.raises(ExportError, match=r"not a generation package .* generation=True"):
        generate_aoti(package[1], PROMPTS[0], 2)


@pytest.mark.parametrize(
    "name, kwargs, error, match",
    [
        ("bert", {"generation": True}, NoKVCacheError, "returned no KV cache"),
        ("llama", {"generation": True, "max_seq": 8}, ExportError, "runs up to max_cache_len"),
        ("llama", {"max_cache_len": 8}, ExportError, "pass generation=True"),
        ("llama", {"generation": True, "max_cache_len": 1}, ExportError, "max_cache_len >= 2"),
    ],
)
def test_bad_input_is_refused_before_anything_is_written(name, kwargs, error, match, tmp_path):
    with pytest.raises(error, match=match):
        kc.export_aoti(zoo.make(name).model, tmp_path / "m.pt2", **kwargs)
    assert not (tmp_path / "m.pt2").exists()


@pytest.mark.slow  # the C++ runner (aoti_runner fixture: 10-25 s of g++ on two cores)
def test_cpp_runner_generates_what_transformers_generates(package, aoti_runner, tmp_path):
    model, path, _ = package
    env = {"PATH": os.environ["PATH"], "OMP_NUM_THREADS": "1"}  # no Python, no kha_compile
    for prompt in PROMPTS:
        ids = tmp_path / "ids.txt"
        ids.write_text(f"{prompt.shape[0]} {prompt.shape[1]}\n" + " ".join(map(str, prompt.flatten().tolist())))
        out = subprocess.run(
            [str(aoti_runner), str(path), "--ids", str(ids), "--generate", str(NEW)],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr[-2000:]
        rows = [[int(x) for x in ln.split()[2:]] for ln in out.stdout.splitlines() if ln.startswith("tokens ")]
        assert rows == _hf_generate(model, prompt).tolist()
        assert any(ln.startswith("gentime ") for ln in out.stdout.splitlines())
    over = subprocess.run(
        [str(aoti_runner), str(path), "1", "30", "--generate", "5"], capture_output=True, text=True, env=env
    )
    assert over.returncode == 1 and "need 1 x 34 cache positions; the package holds 2 x 32" in over.stderr
