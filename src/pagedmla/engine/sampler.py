"""Next-token sampling for a batch: penalties, min_tokens, greedy, temperature, top-k,
top-p, per-request seeds.

All filtering is vectorised over the batch. Presence, frequency and repetition
penalties and the min_tokens mask of stop tokens adjust the logits first, greedy rows
included; they read each row's tokens so far (``TokenHistory``), counted on the device,
and cost nothing when no row of the batch uses them. Random rows are drawn with the
exponential race: ``argmax(probs / E)`` with ``E ~ Exp(1)`` i.i.d. per vocabulary
entry picks token ``v`` with probability ``probs[v]``; the noise of a seeded row
comes from that request's own generator, so its draw does not depend on which
other requests share the batch.

A row whose largest logit is not finite (a NaN anywhere, a +inf, or every logit -inf)
has no distribution to sample from: it is flagged (``DrawnTokens.result``), and the
engine fails that request instead of recording the index the reduction returned.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from pagedmla.engine.sampling_params import GREEDY_TEMPERATURE, SamplingParams

if TYPE_CHECKING:
    from pagedmla.engine.scheduler import ScheduledBatch


@dataclass
class TokenHistory:
    """Each row's tokens so far, which its penalties and min_tokens read; one entry per
    row of the logits.

    With asynchronous scheduling a step may be launched before the token that the step
    before it samples reaches the host: the host's lists then lack that one token. It is
    read on the device instead (``sources``, ``previous``), so that an ahead step
    penalises and counts exactly what a synchronous one would, and the scheduler keeps
    planning ahead for requests that use penalties or min_tokens.

    Attributes:
        token_ids: per row, the request's prompt then generated token ids as the host
            knows them (the sequence's own list: read, never copied unless needed).
        num_prompt_tokens: per row, how many of ``token_ids`` are the prompt.
        eos_token_id: the model's end-of-sequence token, held back with the row's
            ``stop_token_ids`` until min_tokens; None if the model has none.
        sources: per row, the index into ``previous`` of the one generated token the
            host does not know yet, or -1 where it knows them all; None: -1 for all.
        previous: [S] int64 on the logits' device, the tokens sampled by the step before
            (``DrawnTokens.token_ids``); needed where a source is >= 0.
    """

    token_ids: list[list[int]]
    num_prompt_tokens: list[int]
    eos_token_id: int | None = None
    sources: list[int] | None = None
    previous: torch.Tensor | None = None

    @classmethod
    def of(cls, batch: ScheduledBatch, previous: torch.Tensor | None,
           eos_token_id: int | None) -> TokenHistory:
        """The history of ``batch``'s sampled entries (``needs_sample``, in order), with
        ``previous`` the step before's samples that an ahead batch reads (or None)."""
        seqs = [seq for seq, needs in zip(batch.seqs, batch.needs_sample, strict=True) if needs]
        sources = None
        if batch.sources is not None:
            sources = [src for src, needs in zip(batch.sources, batch.needs_sample, strict=True)
                       if needs]
        return cls([seq.token_ids for seq in seqs], [seq.num_prompt_tokens for seq in seqs],
                   eos_token_id, sources, previous)

    def pending(self, row: int) -> bool:
        """Whether ``row`` has a generated token that the host lists lack."""
        return self.sources is not None and self.sources[row] >= 0

    def num_output_tokens(self, row: int) -> int:
        """Tokens ``row``'s request has generated, the one in flight included."""
        return (len(self.token_ids[row]) - self.num_prompt_tokens[row]
                + self.pending(row))


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    history: TokenHistory | None = None,
) -> tuple[torch.Tensor, list[dict[int, float]]]:
    """Draw one token per row of ``logits`` [B, V].

    Args:
        logits: [B, V] next-token logits (converted to float32).
        params: one ``SamplingParams`` per row.
        generators: one per row; a row with a generator draws its noise from it (it must
            live on ``logits.device``), a row with None from torch's default generator.
        history: the rows' tokens so far; needed (ValueError otherwise) when a row has a
            penalty or min_tokens. Those adjust the logits before anything else:
            repetition penalty (prompt and generated tokens), then frequency and
            presence penalties (generated tokens), then min_tokens sets the logits of
            the EOS and stop tokens to -inf while fewer than min_tokens are generated.
            Greedy rows take the argmax of the adjusted logits. A row whose adjusted
            logits are all -inf while its raw ones are finite (only stop tokens are
            possible) is drawn from its raw logits.

    Returns:
        token_ids: [B] int64 on ``logits.device``.
        logprobs: per row, ``{token_id: logprob}`` of the ``params.logprobs`` most likely
            tokens plus the sampled one, taken from ``log_softmax`` of the raw logits
            (before penalties, min_tokens, temperature, top-k and top-p, as vLLM returns
            them by default); empty when ``params.logprobs`` is None.
    """
    drawn = draw(logits, params, generators, history)
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
    history: TokenHistory | None = None,
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
    # It is the raw logits' that flags a row, whatever the penalties make of it.
    peak, token_ids = logits.max(dim=-1)
    finite = torch.isfinite(peak)
    adjusted = _adjusted_logits(logits, finite, params, history)
    if adjusted is not logits:
        token_ids = adjusted.argmax(dim=-1)  # greedy rows: the penalised argmax
    random_rows = [i for i, p in enumerate(params) if p.temperature >= GREEDY_TEMPERATURE]
    if random_rows:
        rows = torch.tensor(random_rows, device=logits.device)
        probs = _filtered_probs(adjusted[rows], [params[i] for i in random_rows])
        noise = _exponential_noise(probs, [generators[i] for i in random_rows])
        token_ids[rows] = (probs / noise).argmax(dim=-1)
    wanted = [p.logprobs for p in params]
    return DrawnTokens(token_ids, finite, _top_logprobs(logits, token_ids, wanted), wanted)


def _adjusted_logits(
    logits: torch.Tensor, finite: torch.Tensor, params: list[SamplingParams],
    history: TokenHistory | None,
) -> torch.Tensor:
    """``logits`` [B, V] float32 after penalties and the min_tokens mask (see ``sample``):
    a new tensor, or ``logits`` itself when no row has either. ``finite`` [B]: whether
    each row's raw largest logit is finite."""
    penalised = [row for row, p in enumerate(params) if p.has_penalties]
    if history is None:
        if penalised or any(p.min_tokens for p in params):
            raise ValueError("rows with penalties or min_tokens need the history of their "
                             "tokens (history=None)")
        return logits
    if len(history.token_ids) != len(params) or len(history.num_prompt_tokens) != len(params):
        raise ValueError(f"need one history entry per row: {len(params)} rows, "
                         f"{len(history.token_ids)} token lists, "
                         f"{len(history.num_prompt_tokens)} prompt lengths")
    held_back = [row for row, p in enumerate(params)
                 if p.min_tokens and history.num_output_tokens(row) < p.min_tokens]
    if not penalised and not held_back:
        return logits
    vocab = logits.shape[1]
    # -- one host array, one copy: the penalised rows, the flat indices of their
    # generated and prompt tokens, the rows with a token in flight and its source, and
    # the flat indices of the logits min_tokens masks --
    outputs = [history.token_ids[row][history.num_prompt_tokens[row]:] for row in penalised]
    prompts = [history.token_ids[row][: history.num_prompt_tokens[row]]
               if params[row].repetition_penalty != 1.0 else [] for row in penalised]
    in_flight = [i for i, row in enumerate(penalised) if history.pending(row)]
    sources = [history.sources[penalised[i]] for i in in_flight] if history.sources else []
    stops = [_held_back_tokens(params[row], history.eos_token_id, vocab) for row in held_back]
    parts = [np.asarray(penalised, np.int64), _flat_index(outputs, vocab),
             _flat_index(prompts, vocab), np.asarray(in_flight, np.int64),
             np.asarray(sources, np.int64), _flat_index(stops, vocab, held_back)]
    uploaded = _upload(np.concatenate(parts), logits.device)
    rows, out_index, prompt_index, in_flight_rows, source_index, stop_index = uploaded.split(
        [part.size for part in parts])
    adjusted = logits.clone()
    if penalised:
        # -- count each row's generated tokens and mark the prompt's: [R, V] --
        counts = torch.zeros(len(penalised) * vocab, device=logits.device)
        counts.scatter_add_(0, out_index, torch.ones_like(out_index, dtype=counts.dtype))
        if in_flight:
            if history.previous is None:
                raise ValueError("history.sources name tokens of the step before, but "
                                 "history.previous is None")
            flight_index = in_flight_rows * vocab + history.previous[source_index]
            counts.scatter_add_(0, flight_index, torch.ones_like(flight_index,
                                                                 dtype=counts.dtype))
        counts = counts.view(len(penalised), vocab)
        generated = counts > 0
        seen = generated.clone()
        seen.view(-1)[prompt_index] = True
        factors = torch.tensor(
            [[p.repetition_penalty, p.frequency_penalty, p.presence_penalty]
             for p in (params[row] for row in penalised)], dtype=torch.float32)
        repetition, frequency, presence = _upload(factors, logits.device).unbind(dim=1)
        # -- repetition penalty (CTRL), then frequency and presence penalties --
        chosen = adjusted.index_select(0, rows)
        repetition = repetition[:, None]
        scaled = torch.where(chosen > 0, chosen / repetition, chosen * repetition)
        chosen = torch.where(seen, scaled, chosen)
        chosen -= frequency[:, None] * counts + presence[:, None] * generated
        # A repetition penalty below 1 may overflow a logit to +inf, whose softmax is NaN.
        chosen.clamp_(max=torch.finfo(chosen.dtype).max)
        adjusted.index_copy_(0, rows, chosen)
    if held_back:
        adjusted.view(-1).index_fill_(0, stop_index, float("-inf"))
    # -- a row left with no finite logit where the raw row has one keeps its raw logits --
    stuck = finite & (adjusted.amax(dim=-1) == float("-inf"))
    return torch.where(stuck[:, None], logits, adjusted)


def _held_back_tokens(params: SamplingParams, eos_token_id: int | None,
                      vocab: int) -> list[int]:
    """The tokens min_tokens holds back: EOS (even with ignore_eos, as vLLM does) and the
    stop tokens, those inside the vocabulary."""
    tokens = list(params.stop_token_ids or [])
    if eos_token_id is not None:
        tokens.append(eos_token_id)
    return [token for token in tokens if token < vocab]


def _flat_index(
    rows: list[list[int]], width: int, row_ids: list[int] | None = None
) -> np.ndarray:
    """int64 indices into a flattened [*, width] tensor of every (row_ids[i], rows[i][j])
    (row_ids default: 0, 1, ...)."""
    lengths = [len(row) for row in rows]
    tokens = np.fromiter(itertools.chain.from_iterable(rows), np.int64, sum(lengths))
    starts = np.asarray(range(len(rows)) if row_ids is None else row_ids, np.int64) * width
    return tokens + np.repeat(starts, lengths)


def _upload(host: np.ndarray | torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` on ``device``; on CUDA from pinned memory, so the copy does not wait for
    the work already queued."""
    tensor = torch.from_numpy(host) if isinstance(host, np.ndarray) else host
    if device.type == "cuda":
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)


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
    # (A top_k past the vocabulary keeps everything; capped, it fits an int64 tensor.)
    top_k = torch.tensor([min(p.top_k, vocab) if p.top_k != -1 else vocab for p in params],
                         device=device)
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
