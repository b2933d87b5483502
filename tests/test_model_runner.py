"""ModelRunner.prepare and sample_rows against inputs spelled out token by token.

The engine steps through prompts of mixed lengths with chunked prefill, prefix hits
and decodes in one batch; every step's vectorised inputs must equal the ones read
directly off the sequences and the block manager.
"""

from __future__ import annotations

import torch

from pagedmla import LLM, SamplingParams
from pagedmla.engine.scheduler import ScheduledBatch
from pagedmla.engine.sequence import Sequence


def expected_inputs(llm: LLM, batch: ScheduledBatch) -> dict[str, list]:
    """Token ids, positions, slots, seq_lens and the zero padded table, one by one."""
    manager = llm.block_manager
    tokens, positions, slots, seq_lens = [], [], [], []
    for seq, num_new in zip(batch.seqs, batch.num_new_tokens, strict=True):
        start = seq.num_computed_tokens
        for position in range(start, start + num_new):
            tokens.append(seq.token_ids[position])
            positions.append(position)
            slots.append(manager.slot(seq, position))
        seq_lens.append(start + num_new)
    width = max(len(seq.block_table) for seq in batch.seqs)
    table = [seq.block_table + [0] * (width - len(seq.block_table)) for seq in batch.seqs]
    rows, end = [], 0
    for num_new, needs_sample in zip(batch.num_new_tokens, batch.needs_sample, strict=True):
        end += num_new
        if needs_sample:
            rows.append(end - 1)
    return dict(tokens=tokens, positions=positions, slots=slots, seq_lens=seq_lens,
                table=table, rows=rows)


def test_prepare_matches_token_by_token_inputs() -> None:
    llm = LLM("tiny", device="cpu", block_size=4, max_num_seqs=6, max_num_batched_tokens=24,
              num_kv_blocks=96)
    params = SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True)
    shared = [9, 8, 7, 6, 5, 4, 3, 2, 1]
    prompts = [shared + [10 + i] * (3 * i) for i in range(8)] + [[42], [43, 44]]
    for i, prompt in enumerate(prompts):
        llm.scheduler.add(Sequence(i, prompt, params))
    kinds = set()
    while llm.scheduler.has_unfinished():
        batch = llm.scheduler.schedule()
        token_ids, positions, spec = llm.runner.prepare(batch)
        want = expected_inputs(llm, batch)
        assert token_ids.dtype == positions.dtype == spec.slot_mapping.dtype == torch.int64
        assert spec.block_table.dtype == torch.int32
        assert token_ids.tolist() == want["tokens"]
        assert positions.tolist() == want["positions"]
        assert spec.slot_mapping.tolist() == want["slots"]
        assert list(spec.seq_lens) == want["seq_lens"]
        assert list(spec.query_lens) == batch.num_new_tokens
        assert spec.block_table.tolist() == want["table"]
        assert llm.runner.sample_rows(batch) == want["rows"]
        kinds.add("decode-only" if batch.num_tokens == len(batch.seqs) else "mixed")
        sampled = {seq.seq_id: (5, {}) for seq, need in
                   zip(batch.seqs, batch.needs_sample, strict=True) if need}
        llm.scheduler.postprocess(batch, sampled)
    assert kinds == {"decode-only", "mixed"}
