"""Next-token sampling for a batch: greedy, temperature, top-k, top-p, per-request seeds.

All filtering is vectorised over the batch. Random rows are drawn with the
exponential race: ``argmax(probs / E)`` with ``E ~ Exp(1)`` i.i.d. per vocabulary
entry picks token ``v`` with probability ``probs[v]``; the noise of a seeded row
comes from that request's own generator, so its draw does not depend on which
other requests share the batch.

A row whose largest logit is not finite (a NaN anywhere, a +inf, or every logit -inf)
has no distribution to sample from: it is flagged (``DrawnTokens.result``), and the
engine fails that request instead of recording the index the reduction returned.
"""

from __future__ import annotations

import torch

from pagedmla.engine.sampling_params import GREEDY_TEMPERATURE, SamplingParams


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> tuple[torch.Tensor, list[dict[int, float]]]:
    """Draw one token per row of ``logits`` [B, V].

    Args:
        logits: [B, V] next-token logits (converted to float32).
        params: one ``SamplingParams`` per row.
        generators: one per row; a row with a generator draws its noise from it (it must
            live on ``logits.device``), a row with None from torch's default generator.

    Returns:
        token_ids: [B] int64 on ``logits.device``.
        logprobs: per row, ``{token_id: logprob}`` of the ``params.logprobs`` most likely
            tokens plus the sampled one, taken from ``log_softmax`` of the raw logits
            (before temperature, top-k and top-p); empty when ``params.logprobs`` is None.
    """
    drawn = draw(logits, params, generators)
    return drawn.token_ids, drawn.result()[1]


class DrawnTokens:
    """Tokens drawn on the device and their copies on the way to the host.

    ``token_ids`` [B] int64 stays on the device, where the next step can read it
    before the host has seen it; ``result()`` waits for the host copies only.
    ``finite`` [B] bool says which rows had a finite largest logit.
    """

    def __init__(
        self, token_ids: torch.Tensor, finite: torch.Tensor,
        top: tuple[torch.Tensor, ...] | None, wanted: list[int | None],
    ) -> None:
        self.token_ids = token_ids
        self._wanted = wanted
        device = token_ids.device
        tensors = (token_ids, finite) + (top or ())
        if device.type == "cuda":
            # Pinned copies that do not wait: a later .tolist() on the device tensors
            # would also wait for whatever the stream runs after this step.
            self._host = [torch.empty_like(t, device="cpu", pin_memory=True) for t in tensors]
            for host, tensor in zip(self._host, tensors, strict=True):
                host.copy_(tensor, non_blocking=True)
            self._copied: torch.cuda.Event | None = torch.cuda.Event()
            self._copied.record(torch.cuda.current_stream(device))
        else:
            self._host, self._copied = list(tensors), None

    def wait(self) -> None:
        """Block until the host copies have landed."""
        if self._copied is not None:
            self._copied.synchronize()

    def result(self) -> tuple[list[int], list[dict[int, float]], list[bool]]:
        """On the host: the token ids [B], per-row logprob dicts (see ``sample``) and
        whether each row's largest logit was finite (a row where it was not has no
        meaningful token: the index the reduction returned)."""
        self.wait()
        token_ids = self._host[0].tolist()
        finite = self._host[1].tolist()
        result: list[dict[int, float]] = [{} for _ in self._wanted]
        if len(self._host) == 2:
            return token_ids, result, finite
        top_values, top_ids, sampled = (t.tolist() for t in self._host[2:])
        for row, k in enumerate(self._wanted):
            if k is None:
                continue
            entries = dict(zip(top_ids[row][:k], top_values[row][:k], strict=True))
            entries[token_ids[row]] = sampled[row]
            result[row] = entries
        return token_ids, result, finite


def draw(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> DrawnTokens:
    """``sample`` without waiting for the device: the arguments as there; the tokens and
    logprobs come from the returned ``DrawnTokens``."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [B, V], got shape {tuple(logits.shape)}")
    if not len(params) == len(generators) == logits.shape[0]:
        raise ValueError(
            f"need one SamplingParams and one generator per row: {logits.shape[0]} rows, "
            f"{len(params)} params, {len(generators)} generators"
        )
    logits = logits.float()
    # max() rather than argmax(): the same first index of the largest logit (greedy rows
    # keep it), and the largest logit itself, which is NaN wherever the row holds a NaN.
    peak, token_ids = logits.max(dim=-1)
    finite = torch.isfinite(peak)
    random_rows = [i for i, p in enumerate(params) if p.temperature >= GREEDY_TEMPERATURE]
    if random_rows:
        rows = torch.tensor(random_rows, device=logits.device)
        probs = _filtered_probs(logits[rows], [params[i] for i in random_rows])
        noise = _exponential_noise(probs, [generators[i] for i in random_rows])
        token_ids[rows] = (probs / noise).argmax(dim=-1)
    wanted = [p.logprobs for p in params]
    return DrawnTokens(token_ids, finite, _top_logprobs(logits, token_ids, wanted), wanted)


def _filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Probabilities after temperature, then top-k, then top-p (on the top-k renormalised)."""
    device = logits.device
    temperatures = torch.tensor([p.temperature for p in params], device=device)
    scaled = logits / temperatures[:, None]
    if all(p.top_k == -1 and p.top_p == 1.0 for p in params):
        return scaled.softmax(dim=-1)  # nothing to filter: skip the sort over the vocabulary
    vocab = scaled.shape[-1]
    # Stable descending sort: among equal logits the lowest id ranks first, as in argmax,
    # so top_k=1 picks exactly the greedy token.
    sorted_logits, order = scaled.sort(dim=-1, descending=True, stable=True)
    ranks = torch.arange(vocab, device=device)
    top_k = torch.tensor([p.top_k if p.top_k != -1 else vocab for p in params], device=device)
    sorted_logits = sorted_logits.masked_fill(ranks >= top_k[:, None], float("-inf"))
    sorted_probs = sorted_logits.softmax(dim=-1)
    # A token is kept while the mass strictly before it is below top_p: the smallest set
    # reaching top_p, never empty (the first token has mass 0 before it). Rows with
    # top_p == 1 are left alone so that rounding in the cumsum cannot cut their tail.
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    top_p = torch.tensor([p.top_p for p in params], device=device)
    outside_nucleus = (mass_before >= top_p[:, None]) & (top_p < 1.0)[:, None]
    sorted_logits = sorted_logits.masked_fill(outside_nucleus, float("-inf"))
    filtered = torch.full_like(scaled, float("-inf")).scatter(-1, order, sorted_logits)
    return filtered.softmax(dim=-1)


def _exponential_noise(
    probs: torch.Tensor, generators: list[torch.Generator | None]
) -> torch.Tensor:
    """Exp(1) noise shaped like ``probs``; rows with a generator draw from it."""
    noise = torch.empty_like(probs).exponential_()
    for row, generator in enumerate(generators):
        if generator is not None:
            noise[row].exponential_(generator=generator)
    # Exp(1) may round to 0; a zero would turn a filtered-out 0 probability into NaN.
    return noise.clamp_min_(torch.finfo(noise.dtype).tiny)


def _top_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, wanted: list[int | None]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """On the device: the top log-probabilities [B, K] and their ids [B, K] for the most
    any row wants (K), and the sampled tokens' log-probabilities [B]; None if no row asks."""
    if all(k is None for k in wanted):
        return None
    logprobs = torch.log_softmax(logits, dim=-1)
    num_top = min(max(k for k in wanted if k is not None), logprobs.shape[-1])
    top_values, top_ids = logprobs.topk(num_top, dim=-1)
    return top_values, top_ids, logprobs.gather(-1, token_ids[:, None])[:, 0]
