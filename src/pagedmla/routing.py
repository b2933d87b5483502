"""Choosing the absorbed MQA path or the MHA path for a request, by cost.

A request with q new tokens over S = C + q keys costs, per layer (N heads):

  MQA (absorbed):   2 N q S (2L + R) flops on the latent rows, plus the absorption of
                    W_UK and W_UV (2 N q L (P + V)); it reads each of the S cache rows
                    (L + R wide) once per group of `rows_per_program` query rows.
  MHA (up-project): 2 N S L (P + V) flops to up-project every key and value, then
                    separate memory passes over the up-projected keys and values, plus
                    attention 2 N q S (P + R + V) (half of the q x q part is masked).

The up-projection is paid per key whatever q is, while MQA pays (2L + R) per query and
key, so MQA wins for q below roughly L (P + V) / (2L + R - P - R - V) tokens
(~170 for DeepSeek shapes at equal efficiency) whatever the context: short chunked
prefill chunks and multi-token decodes belong on the MQA path. Each term is divided by
an effective rate of the path's kernels (`PathCostModel`), fitted to one layer's time
on each path as `python -m benchmarks.bench_routing` measures it. With the defaults the
model predicts a crossover of 260-272 tokens for N = 16 and 128 at 4k and 32k contexts;
that benchmark finds MQA faster at q = 256 and MHA at q = 512 in all four
(docs/PERFORMANCE.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedmla.dims import MLADims


@dataclass(frozen=True)
class PathCostModel:
    """Rates the paths' kernels reach (TFLOP/s, TB/s) and the MQA kernel's row grouping.

    Defaults: the triton backend's rates on an H200, fitted to the whole-layer path
    times of `python -m benchmarks.bench_routing`, launch and absorption overheads
    included (the MQA path's 460 TFLOP/s and 3.8 TB/s, where its decode kernels alone
    reach ~500 and ~4.2; prefill attention ~450 TFLOP/s; up-projection 500 TFLOP/s;
    HBM ~4 TB/s).
    """

    mqa_tflops: float = 460.0
    mqa_tbps: float = 3.8
    mha_tflops: float = 450.0
    matmul_tflops: float = 500.0
    hbm_tbps: float = 4.0
    rows_per_program: int = 64
    element_bytes: int = 2

    def mqa_seconds(self, dims: MLADims, query_len: int, context_len: int) -> float:
        N, L, P, R, V = (dims.num_heads, dims.kv_lora_rank, dims.qk_nope_head_dim,
                         dims.qk_rope_head_dim, dims.v_head_dim)
        q, S = query_len, context_len + query_len
        flops = 2 * N * q * S * (2 * L + R)
        row_groups = -(-N * q // self.rows_per_program)
        bytes_read = row_groups * S * (L + R) * self.element_bytes
        attention = max(flops / (self.mqa_tflops * 1e12), bytes_read / (self.mqa_tbps * 1e12))
        absorb = 2 * N * q * L * (P + V) / (self.matmul_tflops * 1e12)
        return attention + absorb

    def mha_seconds(self, dims: MLADims, query_len: int, context_len: int) -> float:
        N, L, P, R, V = (dims.num_heads, dims.kv_lora_rank, dims.qk_nope_head_dim,
                         dims.qk_rope_head_dim, dims.v_head_dim)
        q, C = query_len, context_len
        S = C + q
        up_flops = 2 * N * S * L * (P + V)
        # Memory passes over the up-projected keys and values, each its own kernel: the
        # matmul writes k_nope and v, k is assembled (read k_nope, write k with k_pe),
        # attention reads k and v.
        up_bytes = S * N * (3 * P + 2 * R + 2 * V) * self.element_bytes
        up = up_flops / (self.matmul_tflops * 1e12) + up_bytes / (self.hbm_tbps * 1e12)
        attention_flops = 2 * N * q * (C + q / 2) * (P + R + V)
        return up + attention_flops / (self.mha_tflops * 1e12)

    def prefers_mqa(self, dims: MLADims, query_len: int, context_len: int) -> bool:
        """True when the absorbed MQA path is predicted to be the cheaper one.

        Only extends (requests with context) are routed: a fresh prompt stays on the MHA
        path, which also keeps its own keys unquantized under an fp8 cache.
        """
        if context_len == 0:
            return False
        return self.mqa_seconds(dims, query_len, context_len) < self.mha_seconds(
            dims, query_len, context_len
        )

    def crossover(self, dims: MLADims, context_len: int, limit: int = 4096) -> int:
        """The largest query length (<= limit) still routed to MQA at this context."""
        best = 0
        for q in range(1, limit + 1):
            if self.prefers_mqa(dims, q, context_len):
                best = q
        return best
