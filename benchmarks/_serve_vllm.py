"""The vLLM side of benchmarks/serve.py, run in the vLLM environment: ``python _serve_vllm.py spec.json out.json``.

Holds one ``vllm.LLM`` per variant in this process at once and runs each workload on them in turns
(a, b, c, a, b, c, ...), so drift on the shared machine hits every variant alike. Prefix caching is
off: every repeat computes its prompts afresh.
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def main() -> None:
    from vllm import LLM, SamplingParams

    with open(sys.argv[1]) as f:
        spec = json.load(f)
    llms, started = {}, {}
    for name, directory in spec["models"].items():
        start = time.perf_counter()
        llms[name] = LLM(
            model=directory,
            skip_tokenizer_init=True,
            dtype="float32",
            enforce_eager=spec["eager"],
            distributed_executor_backend="uni",
            enable_prefix_caching=False,
            max_model_len=spec["max_model_len"],
            seed=0,
        )
        started[name] = time.perf_counter() - start
        print(f"started {name} in {started[name]:.1f} s", file=sys.stderr, flush=True)

    def run(llm, prompts: list[list[int]], new: int) -> float:
        params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        took = time.perf_counter() - start
        assert all(len(o.outputs[0].token_ids) == new for o in outs)
        return took

    decode, batch, new = spec["decode_prompt"], spec["batch_prompts"], spec["new_tokens"]
    for llm in llms.values():  # warm up every path once
        run(llm, [decode], 2)
        run(llm, batch[:2], 2)
    times: dict[str, dict[str, list[float]]] = {n: {"prefill": [], "decode": [], "batch": []} for n in llms}
    for r in range(spec["repeats"]):
        for name, llm in llms.items():  # in turns
            times[name]["prefill"].append(run(llm, [decode], 1))
            times[name]["decode"].append(run(llm, [decode], new))
            times[name]["batch"].append(run(llm, batch, new))
        print(f"repeat {r + 1}/{spec['repeats']} done", file=sys.stderr, flush=True)
    out = {}
    for name, t in times.items():  # per repeat: TPOT from the decode and prefill of the same turn
        tpot = [(d - p) / (new - 1) for d, p in zip(t["decode"], t["prefill"])]
        out[name] = {
            "start_s": started[name],
            "tpot_s": tpot,
            "tokens_per_s": [len(batch) * new / b for b in t["batch"]],
            "raw_s": t,
        }
    with open(sys.argv[2], "w") as f:
        json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
