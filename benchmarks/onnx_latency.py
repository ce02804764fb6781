"""onnxruntime CPU latency: folded linear KHA / baseline and MLP-value KHA / baseline, with file sizes.

BERT-base shapes (hidden 768, 12 heads) and a Llama shape (hidden 1024, 8 q / 4 kv heads), 4 layers
each, random weights; batch 1 and 8, sequence 128. The three files of a model are timed in turns
in one process. Goals: folded / baseline = 1.00 within noise (the graphs are identical),
MLP-value / baseline <= 1.05.

    python benchmarks/onnx_latency.py [--repeats 20] [--small] [--json out.json]
"""

from __future__ import annotations

import argparse
import copy
import os
import pathlib
import tempfile

import torch
from _common import add_threads_arg, apply_threads, deploy_line, deploy_ratios, interleaved_medians, write_json

import kha_compile as kc


def models(small: bool):
    from transformers import BertConfig, BertModel, LlamaConfig, LlamaForCausalLM

    scale = 4 if small else 1
    torch.manual_seed(0)
    bert = BertModel(
        BertConfig(
            hidden_size=768 // scale,
            num_attention_heads=12,
            intermediate_size=3072 // scale,
            num_hidden_layers=4,
            vocab_size=8192,
            attn_implementation="sdpa",
        )
    ).eval()
    llama = LlamaForCausalLM._from_config(
        LlamaConfig(
            hidden_size=1024 // scale,
            intermediate_size=2816 // scale,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=4,
            vocab_size=8192,
        ),
        attn_implementation="sdpa",
    ).eval()
    return {"bert-base-4L": bert, "llama-1024-4L": llama}


def variants(model):
    out = {"baseline": model}
    for name, cfg in (
        ("folded-linear", kc.KHAConfig(q="linear", k="linear", v="linear")),
        ("mlp-value", kc.KHAConfig(v="mlp")),
    ):
        m = copy.deepcopy(model)
        kc.apply(m, cfg)
        with torch.no_grad():
            for n, p in m.named_parameters():
                if ".kha." in n:
                    p.add_(0.02 * torch.randn_like(p))
        out[name] = m
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--small", action="store_true")
    add_threads_arg(ap)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    apply_threads(args)
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = torch.get_num_threads()
    record: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mname, model in models(args.small).items():
            paths = {}
            for vname, m in variants(model).items():
                paths[vname] = kc.export_onnx(m, pathlib.Path(tmp) / f"{mname}-{vname}.onnx")
            sessions = {
                v: ort.InferenceSession(str(p), opts, providers=["CPUExecutionProvider"]) for v, p in paths.items()
            }
            sizes = {
                v: os.path.getsize(p)
                + sum(os.path.getsize(x) for x in pathlib.Path(tmp).glob(f"{pathlib.Path(p).name}.*"))
                for v, p in paths.items()
            }
            print(f"{mname}: ONNX sizes " + ", ".join(f"{v} {s / 2**20:.1f} MiB" for v, s in sizes.items()))
            for batch in (1, 8):
                ids = torch.randint(0, 8192, (batch, args.seq)).numpy()
                feeds = {}
                for v, sess in sessions.items():
                    names = [i.name for i in sess.get_inputs()]
                    feeds[v] = {
                        n: (ids if "input_ids" in n else (ids * 0 + 1) if "mask" in n else ids * 0) for n in names
                    }
                t = interleaved_medians(
                    {v: (lambda s=s, f=feeds[v]: s.run(None, f)) for v, s in sessions.items()}, args.repeats
                )
                record[f"{mname}/b{batch}"] = rec = deploy_ratios(t)
                print(deploy_line(f"batch {batch}, seq {args.seq}", rec))
            record[f"{mname}/sizes"] = sizes
    write_json(args.json, record)
    return record


if __name__ == "__main__":
    main()
