"""Runs in the vLLM environment (transformers < 5.20): jobs from a JSON file in, results as JSON out.

    python _vllm_worker.py jobs.json results.json

Job kinds, run in the order given, each isolated (an error is a result, never the end of the run):
- ``generate``: ``vllm.LLM(model=dir, ...)``, greedy tokens of the prompts (one batch), then the same
  batch again (the prefix cache holds the shared prefix by then) with the number of cached tokens;
  ``break`` (a role) patches kha_compile's plugin to drop that role's KHA (the test shows that this fails);
- ``refuse``: ``vllm.LLM(...)`` must raise before generating; the result is the error's type and message
  (``old_vllm``: the plugin is registered again as on a vLLM older than it needs; ``no_plugins``: vLLM
  loads no plugin, as where kha_compile is not installed; only as the first job);
- ``quantize``: compressed-tensors quantization of a directory into another (serve_quantize.py);
- ``kha_save``: the base model of one directory with the KHA ``kc.save_pretrained`` wrote into another
  (``kc.load_pretrained``), saved by ``kc.save_pretrained`` into a third: the trained KHA beside a quantized base;
- ``hf``: kha_compile on this environment's transformers: ``kc.load_pretrained`` of the directory into
  ``AutoModelForCausalLM.from_pretrained(dir)`` and greedy ``generate``.

The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``; one worker process per rank at
tensor_parallel_size > 1), so the patches of ``break`` reach the model, and one Python start serves
every job. vLLM runs a full ``gc.collect()`` eight times per engine start and shutdown, each 0.3 s over the
heap of torch, transformers and vLLM: that heap is frozen (``gc.freeze``) after the imports and after each
job, and vLLM's ``gc.unfreeze`` at shutdown is a no-op here, so those collections see only the job's own
objects (a job takes 1 s instead of 3.5 s; what vLLM computes is unchanged).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import sys
import time
import traceback
from typing import Any

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


@contextlib.contextmanager
def _broken(role: str | None):
    """Patch the plugin to drop the KHA of ``role`` (folded or run-time) from every attention."""
    if not role:
        yield
        return
    from kha_compile.serving.vllm import composed, method

    def dropping(original):
        def process(self, layer):
            self.kinds = {r: k for r, k in self.kinds.items() if r != role}
            self.running = [r for r in self.running if r != role]
            return original(self, layer)

        return process

    classes = (method.KHAQKVMethod, composed.WrappedQKVMethod)  # on a plain base, on a quantized one
    originals = [c.process_weights_after_loading for c in classes]
    for cls, original in zip(classes, originals):
        cls.process_weights_after_loading = dropping(original)
    try:
        yield
    finally:
        for cls, original in zip(classes, originals):
            cls.process_weights_after_loading = original


@contextlib.contextmanager
def _old_vllm(old: bool):
    """Register the plugin again as on vLLM 0.31 (the stand-in that refuses KHA directories), then restore it."""
    if not old:
        yield
        return
    import vllm

    from kha_compile.serving.vllm import plugin

    real = vllm.__version__
    vllm.__version__ = "0.31.0"
    try:
        plugin.register()
        yield
    finally:
        vllm.__version__ = real
        plugin.register()


def _llm(job: dict[str, Any]):
    from vllm import LLM

    tp = int(job.get("tp", 1))
    kwargs = dict(
        model=job["model"],
        skip_tokenizer_init=True,
        dtype="float32",
        enforce_eager=True,
        tensor_parallel_size=tp,
        distributed_executor_backend="uni" if tp == 1 else "mp",
        block_size=job.get("block_size", 32),
        max_model_len=512,
        enable_prefix_caching=True,
        seed=0,
    )
    kwargs.update(job.get("llm", {}))
    return LLM(**kwargs)


def _close(llm) -> None:
    from vllm.distributed import cleanup_dist_env_and_memory

    if llm is not None:
        with contextlib.suppress(Exception):
            llm.llm_engine.engine_core.shutdown()
    cleanup_dist_env_and_memory()


def _generate(job: dict[str, Any]) -> dict[str, Any]:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=job["new_tokens"], temperature=0.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in job["prompts"]]
    llm = None
    try:
        with _broken(job.get("break")):
            start = time.perf_counter()
            llm = _llm(job)
            started = time.perf_counter() - start
        first = llm.generate(prompts, params, use_tqdm=False)
        again = llm.generate(prompts, params, use_tqdm=False)  # the shared prefix is in the cache now
        extra = {}
        if job.get("logprobs"):
            scoring = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
            scored = llm.generate(prompts, scoring, use_tqdm=False)
            extra["logprobs"] = [
                [lp[t].logprob for lp, t in zip(o.prompt_logprobs[1:], p["prompt_token_ids"][1:])]
                for o, p in zip(scored, prompts)
            ]
        return extra | {
            "quantization": llm.llm_engine.model_config.quantization,
            "tokens": [list(o.outputs[0].token_ids) for o in first],
            "again": [list(o.outputs[0].token_ids) for o in again],
            "cached": [int(o.num_cached_tokens or 0) for o in again],
            "start_s": round(started, 2),
        }
    finally:
        _close(llm)


@contextlib.contextmanager
def _without_plugins(off: bool):
    """vLLM without its general plugins (``VLLM_PLUGINS`` naming none), as where kha_compile is not installed."""
    if not off:
        yield
        return
    import vllm.plugins

    assert not vllm.plugins.plugins_loaded, "a job without plugins must come before every other job"
    os.environ["VLLM_PLUGINS"] = ""
    try:
        yield
    finally:
        del os.environ["VLLM_PLUGINS"]
        vllm.plugins.plugins_loaded = False  # the next job loads them


def _refuse(job: dict[str, Any]) -> dict[str, Any]:
    llm = None
    try:
        with _old_vllm(bool(job.get("old_vllm"))), _without_plugins(bool(job.get("no_plugins"))):
            llm = _llm(job)
        return {"error": None}
    except Exception as exc:  # the refusal under test
        return {"error": type(exc).__name__, "message": str(exc), "module": type(exc).__module__}
    finally:
        _close(llm)


def _hf(job: dict[str, Any]) -> dict[str, Any]:
    import transformers
    from serve_greedy import greedy

    import kha_compile as kc

    model = transformers.AutoModelForCausalLM.from_pretrained(job["model"]).eval()
    if job.get("kha", True):
        kc.load_pretrained(model, job["model"])
    return {"runs": greedy(model, job["prompts"], job["new_tokens"]), "transformers": transformers.__version__}


def _quantize(job: dict[str, Any]) -> dict[str, Any]:
    from serve_quantize import quantize

    return quantize(job["model"], job["out"], job.get("scheme", "W8A8"))


def _freeze_heap() -> None:
    """Leave what is alive now out of every later collection (see the module doc)."""
    gc.collect()
    gc.freeze()


def _kha_save(job: dict[str, Any]) -> dict[str, Any]:
    import transformers

    import kha_compile as kc

    model = transformers.AutoModelForCausalLM.from_pretrained(job["model"])
    kc.load_pretrained(model, job["kha"])
    kc.save_pretrained(model, job["out"])
    return {}


def main() -> None:
    with open(sys.argv[1]) as f:
        jobs = json.load(f)
    results: dict[str, Any] = {}
    import vllm  # noqa: F401 - the heap the engine's collections would walk each time

    gc.unfreeze = lambda: None  # vLLM's shutdown would thaw it
    _freeze_heap()
    run = {"generate": _generate, "refuse": _refuse, "hf": _hf, "quantize": _quantize, "kha_save": _kha_save}
    for job in jobs:
        start = time.perf_counter()
        try:
            results[job["name"]] = run[job["kind"]](job)
        except Exception:
            results[job["name"]] = {"crash": traceback.format_exc()[-4000:]}
        results[job["name"]]["seconds"] = round(time.perf_counter() - start, 2)
        print(f"job {job['name']}: {results[job['name']].get('seconds')} s", file=sys.stderr, flush=True)
        _freeze_heap()
        with open(sys.argv[2], "w") as f:  # after every job: a crash of the process keeps what was done
            json.dump(results, f)


if __name__ == "__main__":  # vLLM starts its rank workers with spawn, which imports this file again
    main()
