"""How the reference engine picks each generated token, and when it stops: SGLang's rules on CPU.

Greedy below SGLang's temperature epsilon (the arg max, as transformers' ``generate`` takes it); otherwise
the softmax of ``logits / temperature`` cut to the smallest set of tokens whose probability reaches
``top_p`` (SGLang's ``top_k_top_p_min_p_sampling_from_probs_torch``: a token is dropped when the mass
before it already exceeds ``top_p``), drawn with a generator seeded by ``sampling_seed``. The same seed
gives the same tokens for the same prompt: one request at a time, there is no batch to change them.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from transformers import PreTrainedModel

from hsx.engine.regenerate_contract import GenerationParams


def generator_for(params: GenerationParams) -> torch.Generator | None:
    """The request's own generator: seeded when it names a seed, from the OS otherwise; none for greedy."""
    if params.greedy:
        return None
    generator = torch.Generator(device="cpu")
    if params.seed is None:
        generator.seed()
    else:
        generator.manual_seed(params.seed)
    return generator


def next_token(logits: torch.Tensor, params: GenerationParams, generator: torch.Generator | None) -> int:
    """The token after ``logits`` (the last position's, [vocab])."""
    if generator is None:
        return int(logits.argmax().item())
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        before = sorted_probs.cumsum(dim=-1) - sorted_probs
        sorted_probs[before > params.top_p] = 0.0
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator).item())


def model_eos_ids(model: PreTrainedModel) -> frozenset[int]:
    """The ids a generation always stops on: ``eos_token_id`` of the model's config and of its generation
    config, as SGLang's ``ModelConfig._get_hf_eos_token_id`` gathers them."""
    ids: set[int] = set()
    for config in (model.config, getattr(model, "generation_config", None)):
        ids.update(_as_ids(getattr(config, "eos_token_id", None)))
    return frozenset(ids)


def _as_ids(value: int | Iterable[int] | None) -> set[int]:
    if value is None:
        return set()
    if isinstance(value, int):
        return {value}
    return {int(token) for token in value}
