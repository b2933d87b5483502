"""The start-up warm-up: requests of random tokens that reach every kernel variant an
engine's configuration can, run once before the engine reports ready.

Triton and Gluon kernels compile on the first launch of each specialization. The kernels
mark their batch-dependent integers (token and request counts, strides that follow them)
`do_not_specialize`, and their views into packed metadata
`do_not_specialize_on_alignment` (but for the fp8 GEMM's row count and the split-KV
combine's partial strides, whose vector loads gain from them), so a specialization is
fixed by the configuration (head count, page size, cache dtype, model widths) and by a
few ladders of sizes that the kernels' launch code picks from: token counts (the GEMM and
MoE tile configs, the prefill head groups), request counts (the split planner's blocks),
query rows per request (the decode kernel and its head block) and the longest context
(the split-KV splits; the engine fixes it for decode rows at max_model_len, as its CUDA
graphs do: `MLAMetadataBuilder(decode_bound=...)`). `warmup_cases` walks them with whole
engine steps, so that the paths between kernels (CUDA graphs, eager rows, chunked
context, prefix hits, the absorbed MQA route, sampling) are the ones that serve later.
`benchmarks/bench_startup.py` counts the variants built after start-up.

`LLM.warm_up` runs them (on the CPU, where only a torch.compile'd step compiles,
`compiled_step_cases`), then starts over as new: the prefix cache is emptied, the
request ids, the statistics and the sampling generator start over.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, replace

from tqdm.auto import tqdm

from pagedmla.engine.piecewise import MAX_TOKENS as PIECEWISE_MAX_TOKENS
from pagedmla.engine.sampling_params import SamplingParams

GREEDY = dict(temperature=0.0, ignore_eos=True)
# Suffixes after a cached prefix: short ones take the absorbed MQA route (1, 2, 3 and
# more query rows per request pick different decode kernels), long ones MHA.
SUFFIXES = (1, 2, 3, 5, 9, 17, 64, 300)
# Request counts of a step: both sides of the split planner's block sizes (16, 32, 64)
# and of its small-batch rule (2), then max_num_seqs.
REQUEST_COUNTS = (1, 2, 3, 9, 16, 17, 33, 65, 129)
# Contexts past this add no split-KV variant: a request's splits stop at 128 of at least
# 128 positions (ops/triton/split_plan.py).
LONGEST_CONTEXT = 128 * 256


@dataclass
class WarmupCase:
    """One generate call: prompts of these lengths (each of fresh random tokens, after
    `prefix` random tokens that every case of that prefix length shares), `max_tokens`
    each, sampled by `params` (greedy if None)."""

    name: str
    lengths: list[int]
    max_tokens: int = 2
    prefix: int = 0
    params: SamplingParams | None = None


def compiled_step_cases(max_model_len: int) -> list[WarmupCase]:
    """Where no kernel compiles on first use (the CPU), a torch.compile'd step's two
    graphs: a step of two one-token prompts, then one of a single token (token counts are
    dynamic past one); none where a prompt and its token do not fit max_model_len."""
    if max_model_len < 2:
        return []
    return [WarmupCase("compiled step, 2 tokens", [1, 1], max_tokens=1),
            WarmupCase("compiled step, 1 token", [1], max_tokens=1)]


def _pow2_ladder(low: int, high: int) -> list[int]:
    """low, 2 low, 4 low, .. below high, then high."""
    sizes = []
    size = low
    while size < high:
        sizes.append(size)
        size *= 2
    return [*sizes, high] if high >= low else sizes


def warmup_cases(max_model_len: int, max_num_seqs: int, max_num_batched_tokens: int,
                 prefix_caching: bool, cache_tokens: int) -> list[WarmupCase]:
    """The generate calls that walk the size ladders of an engine of these limits, whose
    cache holds `cache_tokens` (each call's tokens fit in half of it)."""
    budget = max_num_batched_tokens
    # Room for the generated tokens; each call's prompts fit the cache with room to spare.
    longest = min(max_model_len - 4, LONGEST_CONTEXT, cache_tokens // 4)
    counts = [c for c in REQUEST_COUNTS if c < max_num_seqs] + [max_num_seqs]
    cases = []
    # Prompts alone: one step each up to the token budget (the step's GEMMs, MoE tiles and
    # prefill head groups by length), unequal lengths (the varlen kernels) and equal ones
    # (the dense prefill path).
    for length in _pow2_ladder(16, min(budget, longest)):
        cases.append(WarmupCase(f"prompt {length}", [length, max(1, length - 3)]))
        cases.append(WarmupCase(f"prompts 2x{length}", [length // 2] * 2))
    # Many requests in one step, then decoding together (the decode rows' and the split
    # planner's block sizes by request count).
    for count in counts:
        lengths = [4 + i % 5 for i in range(min(count, cache_tokens // 64))]
        cases.append(WarmupCase(f"{count} requests", lengths, max_tokens=3))
    # Longer than a step: prefill chunks over cached context; the later prompts of the
    # call arrive while the first ones decode (mixed steps).
    if longest > budget:
        cases.append(WarmupCase("chunked", [min(longest, 3 * budget + 5)], max_tokens=3))
    # Steps past the largest piecewise graph run eagerly, their decode rows too: count
    # requests decode while long prompts fill such steps (the split planner's blocks by
    # request count, as above for the graphs).
    long = min(longest, budget // 2 + 1100)
    if budget > PIECEWISE_MAX_TOKENS and 2 * long - budget > PIECEWISE_MAX_TOKENS:
        for count in counts:
            if 3 * long + 4 * count <= cache_tokens // 2:
                cases.append(WarmupCase(f"{count} decodes in eager steps",
                                        [4] * count + [long] * 3, max_tokens=3))
    # Extends after a cached prefix (each call's prompts share it with the call before):
    # of each context length with short suffixes (MQA) and long ones (MHA over the
    # context); and 2 or 3 query rows (the MQA kernels' head blocks) for each request
    # count.
    if prefix_caching:
        for context in _pow2_ladder(64, longest - 1):
            suffixes = [n for n in SUFFIXES if context + n <= longest]
            cases.append(WarmupCase(f"prefix {context}", [0], max_tokens=1, prefix=context))
            cases.append(WarmupCase(f"extends {context}", suffixes, prefix=context))
        context = min(256, longest // 2)
        for count in (c for c in (1, 3, 17, 33, 65) if c <= max_num_seqs):
            for rows in (2, 3):
                cases.append(WarmupCase(f"{count} extends of {rows}", [rows] * count,
                                        prefix=context))
    # Sampling: temperature, top-k / top-p, penalties, seeds and logprobs.
    sampled = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, presence_penalty=0.5,
                             frequency_penalty=0.2, repetition_penalty=1.1, min_tokens=2,
                             seed=0, logprobs=5, max_tokens=4, ignore_eos=True)
    cases.append(WarmupCase("sampled", [7, 12, 30], params=sampled))
    # Within max_model_len (each case generates 4 tokens at most): shorter prompts.
    return [replace(case, lengths=[max(1, min(n, longest - case.prefix))
                                   for n in case.lengths])
            for case in cases if case.prefix < longest]


def run_cases(generate: Callable[..., object], cases: list[WarmupCase], vocab_size: int,
              show_progress: bool = True) -> None:
    """Run each case through `generate` (`LLM.generate`) on random tokens below
    vocab_size (seeded: the same every start)."""
    rng = random.Random(0)
    prefixes: dict[int, list[int]] = {}  # by length: cases of one length share theirs

    def tokens(count: int) -> list[int]:
        return [rng.randrange(vocab_size) for _ in range(count)]

    for case in tqdm(cases, desc="warm-up", disable=not show_progress):
        if case.prefix not in prefixes:
            prefixes[case.prefix] = tokens(case.prefix)
        prefix = prefixes[case.prefix]
        prompts = [prefix + tokens(length) for length in case.lengths]
        params = case.params or SamplingParams(max_tokens=case.max_tokens, **GREEDY)
        generate(prompts, params, use_tqdm=False)
