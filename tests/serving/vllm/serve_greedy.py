"""transformers' greedy generation with the margin of each token; imported in the vLLM environment too
(torch and transformers only, nothing else of the tests)."""

from __future__ import annotations

import torch
from torch import nn

NEW_TOKENS = 10


def greedy(model: nn.Module, prompts: list[list[int]], new_tokens: int = NEW_TOKENS) -> list[dict[str, list]]:
    """transformers' greedy ``generate`` per prompt: tokens and the top-1 minus top-2 logit per step."""
    model.generation_config.eos_token_id = None  # generate every token (vLLM runs with ignore_eos)
    model.generation_config.pad_token_id = 0
    out = []
    with torch.no_grad():
        for p in prompts:
            res = model.generate(
                torch.tensor([p]),
                max_new_tokens=new_tokens,
                do_sample=False,
                output_scores=True,
                return_dict_in_generate=True,
            )
            top = torch.stack([s[0].float().topk(2).values for s in res.scores])  # (steps, 2)
            out.append({"tokens": res.sequences[0, len(p) :].tolist(), "margins": (top[:, 0] - top[:, 1]).tolist()})
    return out
