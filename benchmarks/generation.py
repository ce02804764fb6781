"""Time per generated token from the exported files, with and without a KV cache, for each target that runs here.

A transformers Llama (hidden 512, 8 q / 4 kv heads of 64, 2 layers, vocab 4096, random weights) with
MLP-value KHA on v (the kind that does not fold, so these files are the only way out of Python) and
trained-like KHA weights, exported four times:

- ONNX with a KV cache (``kc.export_onnx(model, dir, past=True)``), run by a plain onnxruntime loop
  (``generate_onnx``) and by onnxruntime-genai (its own loop over ``genai_config.json``);
- ONNX without a cache (``kc.export_onnx(model, "m.onnx")``): each token a forward over the whole sequence;
- an AOTInductor package with a static cache (``kc.export_aoti(model, "g.pt2", generation=True)``,
  ``generate_aoti``) and one without (``kc.export_aoti(model, "m.pt2")``, a forward over the whole sequence
  per token);
- and, for reference, transformers' ``generate`` in eager torch with and without its cache.

Each variant generates ``--new`` tokens greedily after a prompt of ``--prompt`` tokens (batch 1); the
variants run in turns, ``--repeats`` times, and the table gives the median time per new token (the
prompt's forward included) and the ratio without / with the cache. Every variant's tokens are checked
against transformers' ``generate`` first.

    python benchmarks/generation.py [--prompt 64] [--new 32] [--repeats 5] [--threads 1] [--json out.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import pathlib
import statistics
import tempfile
import time

import torch
from _common import add_threads_arg, apply_threads, finish, interleaved_times

import kha_compile as kc
from kha_compile.exporters.generate import generate_aoti, generate_genai, generate_onnx, greedy

SHAPE = dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4)
VOCAB = 4096


def kha_model() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(**SHAPE, head_dim=64, vocab_size=VOCAB, max_position_embeddings=512)
    model = LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa").eval()
    model.generation_config.eos_token_id = None  # every variant generates all --new tokens
    kc.apply(model, kc.KHAConfig(v="mlp"))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # trained-like KHA weights
        for n, p in model.named_parameters():
            if ".kha." in n:
                p.add_(0.02 * torch.randn(p.shape, generator=gen))
    return model


def no_cache_step(run):
    """A greedy step that runs ``run(all ids so far)`` (B, T) -> logits (B, T, V): no cache, the whole sequence."""
    seen: list[torch.Tensor] = []

    def step(ids: torch.Tensor, start: int) -> torch.Tensor:
        if start == 0:
            seen.clear()
        seen.append(ids)
        return run(torch.cat(seen, 1))[:, start:]

    return step


def ort_session(path: pathlib.Path):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = opts.inter_op_num_threads = torch.get_num_threads()
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def build(model: torch.nn.Module, tmp: pathlib.Path, new: int, max_len: int) -> tuple[dict, dict]:
    """Export every file; returns the variants {target: {"with cache" | "without cache": fn(prompt)}} and build seconds."""
    import onnxruntime_genai as og

    built: dict[str, float] = {}

    def timed(name, fn):
        start = time.perf_counter()
        out = fn()
        built[name] = time.perf_counter() - start
        return out

    past = timed("onnx with past", lambda: kc.export_onnx(model, tmp / "genai", past=True))
    config = json.loads((tmp / "genai" / "genai_config.json").read_text())  # genai's threads, as torch's
    config["model"]["decoder"]["session_options"]["intra_op_num_threads"] = torch.get_num_threads()
    (tmp / "genai" / "genai_config.json").write_text(json.dumps(config))
    plain = timed("onnx", lambda: kc.export_onnx(model, tmp / "plain.onnx"))
    gen_pt2 = timed(
        "aoti generation", lambda: kc.export_aoti(model, tmp / "gen.pt2", generation=True, max_cache_len=max_len)
    )
    plain_pt2 = timed("aoti", lambda: kc.export_aoti(model, tmp / "plain.pt2"))

    past_sess, plain_sess = ort_session(past), ort_session(plain)
    genai_model = og.Model(str(tmp / "genai"))
    gen_runner = torch._inductor.aoti_load_package(str(gen_pt2))
    plain_runner = torch._inductor.aoti_load_package(str(plain_pt2))
    plain_names = [i.name for i in plain_sess.get_inputs()]

    def ort_full(ids):
        feeds = {"input_ids": ids.numpy(), "attention_mask": torch.ones_like(ids).numpy()}
        return torch.from_numpy(plain_sess.run(None, {n: feeds[n] for n in plain_names})[0])

    def eager(ids, use_cache):
        with torch.no_grad():
            return model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False, use_cache=use_cache
            )

    variants = {
        "torch eager (transformers generate)": {
            "with cache": lambda ids: eager(ids, True),
            "without cache": lambda ids: eager(ids, False),
        },
        "onnxruntime": {
            "with cache": lambda ids: generate_onnx(past, ids, new, session=past_sess),
            "without cache": lambda ids: greedy(no_cache_step(ort_full), ids, new),
        },
        "onnxruntime-genai": {"with cache": lambda ids: generate_genai(tmp / "genai", ids, new, model=genai_model)},
        "AOTInductor": {
            "with cache": lambda ids: generate_aoti(gen_pt2, ids, new, runner=gen_runner),
            "without cache": lambda ids: greedy(
                no_cache_step(lambda t: plain_runner(t, torch.ones_like(t))[0]), ids, new
            ),
        },
    }
    return variants, built


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    add_threads_arg(ap)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    apply_threads(args)
    new = args.new
    model = kha_model()
    prompt = torch.randint(0, VOCAB, (1, args.prompt), generator=torch.Generator().manual_seed(2))
    want = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new, do_sample=False)
    record: dict = {"shape": SHAPE, "vocab": VOCAB, "prompt": args.prompt, "new": new, "kha": "mlp on v"}
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        variants, built = build(copy.deepcopy(model), pathlib.Path(tmp), new, args.prompt + new)
        record["build_s"] = built
        fns = {}
        for target, kinds in variants.items():
            for kind, fn in kinds.items():
                got = fn(prompt)
                assert torch.equal(got, want), f"{target} {kind}: {got.tolist()} != {want.tolist()}"
                fns[f"{target} | {kind}"] = lambda fn=fn: fn(prompt)
        times = {k: statistics.median(v) / new for k, v in interleaved_times(fns, args.repeats, warmup=1).items()}
    print(
        f"Llama hidden {SHAPE['hidden_size']}, {SHAPE['num_hidden_layers']} layers, vocab {VOCAB}, MLP-value KHA on v; "
        f"batch 1, prompt {args.prompt}, {new} new tokens; {torch.get_num_threads()} thread(s); "
        f"median of {args.repeats} turns; every variant's tokens = transformers' generate"
    )
    print("build: " + ", ".join(f"{k} {v:.0f} s" for k, v in built.items()))
    print("| target | with cache (ms/token) | without cache (ms/token) | without / with |")
    print("| --- | --- | --- | --- |")
    rows = {}
    for target in variants:
        w = times[f"{target} | with cache"] * 1e3
        wo = times.get(f"{target} | without cache")
        rows[target] = {"with_cache_ms": w, "without_cache_ms": None if wo is None else wo * 1e3}
        ratio = "n/a (always cached)" if wo is None else f"{wo * 1e3 / w:.2f}"
        print(f"| {target} | {w:.2f} | {'-' if wo is None else f'{wo * 1e3:.2f}'} | {ratio} |")
    record["per_token"] = rows
    return finish(record, load_before, args.json)


if __name__ == "__main__":
    main()
