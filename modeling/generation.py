"""Sampling text from a causal model at a chosen tier: MatFormer's elastic inference.

    ids = generate(model, prompt_ids, tier=2, max_new_tokens=64, temperature=0.8, top_p=0.9)

Each step takes the logits of the last position, scaled by ``temperature`` and cut to the
``top_k`` most likely tokens and to the smallest set whose probability reaches ``top_p``,
and draws the next token (``temperature=0``: the most likely one, greedy). With the KV
cache (the default) a step feeds only the new token; without it, the whole sequence again,
which gives the same tokens (``tests/test_generation.py``) at quadratic cost. Models whose
attention bias depends on the query's position against every key's (ALiBi), and those whose
attention kernel cannot decode from a cache (``decodes_with_cache = False``: WERSA),
generate without it, saying so once per call.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor

from matformer.modeling.components.positional import PositionalEncoding
from matformer.modeling.errors import ConfigError
from matformer.modeling.generation_cache import KVCache
from matformer.modeling.matformer import Tier
from matformer.modeling.models import TransformerWithLMHead

log = logging.getLogger("matformer.generation")


@torch.no_grad()
def generate(
    model: TransformerWithLMHead,
    prompt: Tensor,
    *,
    tier: Tier | None = None,
    max_new_tokens: int = 64,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_token_id: int | None = None,
    generator: torch.Generator | None = None,
    use_cache: bool = True,
) -> Tensor:
    """The prompt's token ids (T,) followed by up to ``max_new_tokens`` generated ones,
    stopping after ``eos_token_id``. Sampling draws from ``generator`` (on the CPU)."""
    if not model.config.is_causal:
        raise ConfigError("generation needs a causal model; this one is masked (BERT-style).")
    if temperature < 0 or (top_p is not None and not 0 < top_p <= 1) or \
            (top_k is not None and top_k < 1):
        raise ConfigError(f"temperature must be >= 0, top_k >= 1 and top_p in (0, 1]; got "
                          f"{temperature}, {top_k}, {top_p}.")
    room = model.config.max_position_embeddings - len(prompt)
    if len(prompt) == 0 or room < 1:
        raise ConfigError(f"the prompt has {len(prompt)} tokens; it needs at least 1 and at "
                          f"most {model.config.max_position_embeddings - 1} (the model's "
                          "max_position_embeddings less one to generate).")
    positional = type(model.model.embed_positions)
    if use_cache and positional.score_bias is not PositionalEncoding.score_bias:
        log.warning("matformer: %s adds a bias over query-key distances; generating without "
                    "the KV cache", positional.__name__)
        use_cache = False
    uncached = {type(m).__name__ for m in model.modules()
                if not getattr(m, "decodes_with_cache", True)}
    if use_cache and uncached:
        log.warning("matformer: %s attention cannot decode from a KV cache; generating "
                    "without it", ", ".join(sorted(uncached)))
        use_cache = False
    model.eval()
    ids = prompt[None]  # (1, T)
    cache = KVCache() if use_cache else None
    step_input, start = ids, 0
    for _ in range(min(max_new_tokens, room)):
        positions = torch.arange(start, start + step_input.shape[1], device=ids.device)[None]
        logits = model(step_input, position_ids=positions, tier=tier, cache=cache)[0, -1]
        token = _draw(logits.float(), temperature, top_k, top_p, generator)
        ids = torch.cat((ids, token.view(1, 1).to(ids.device)), dim=1)
        if eos_token_id is not None and int(token) == eos_token_id:
            break
        if cache is not None:
            step_input, start = ids[:, -1:], ids.shape[1] - 1
        else:
            step_input = ids
    return ids[0]


def _draw(logits: Tensor, temperature: float, top_k: int | None, top_p: float | None,
          generator: torch.Generator | None) -> Tensor:
    """The next token from one position's logits (V,)."""
    if temperature == 0:
        return logits.argmax()
    logits = logits / temperature
    if top_k is not None and top_k < logits.numel():
        kth = logits.topk(top_k).values[-1]
        logits = logits.masked_fill(logits < kth, -torch.inf)
    if top_p is not None and top_p < 1:
        ordered, order = logits.sort(descending=True)
        mass = ordered.softmax(-1).cumsum(-1)
        cut = mass - ordered.softmax(-1) >= top_p  # tokens past the nucleus
        logits = logits.scatter(0, order, ordered.masked_fill(cut, -torch.inf))
    probabilities = logits.softmax(-1).cpu()
    return torch.multinomial(probabilities, 1, generator=generator)[0]
