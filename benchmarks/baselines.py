"""The PyTorch baselines the kernel benchmarks time our kernels against.

* decode: `torch_decode`, plain PyTorch as a user would write it (gather + bmm);
* prefill: `sdpa_baseline`, the faster of PyTorch's cuDNN and flash SDPA.

(The merge's baseline, `torch.compile` of the reference op, is built where it is timed.)
"""

from __future__ import annotations

import torch

from benchmarks.harness import bench_covered


def torch_decode(q: torch.Tensor, data: torch.Tensor, scale: torch.Tensor,
                 block_table: torch.Tensor, seq_lens: torch.Tensor,
                 query_start_loc: torch.Tensor, max_query_len: int, max_seq_len: int,
                 kv_lora_rank: int, softmax_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The decode baseline: plain PyTorch as a user would write it (gather + bmm).

    mla_decode's arguments, for a batch whose B requests each have one query token and
    exactly max_seq_len positions, a whole number of pages, on a 16-bit cache (the
    caller's promise: checking seq_lens would read it back). Each request's pages are
    gathered into one [B, C, L + R] tensor; then S = q K^T in q's dtype (cuBLAS,
    float32 accumulation), a float32 softmax, and O = P V. Returns out [B, N, L] and
    lse [N, B].
    """
    num_reqs, num_heads = seq_lens.shape[0], q.shape[1]
    page = data.shape[1]
    if q.shape[0] != num_reqs or max_query_len != 1:
        raise ValueError(f"q: one token per request expected, got {q.shape[0]} tokens "
                         f"for {num_reqs} requests (max_query_len {max_query_len})")
    if max_seq_len % page:
        raise ValueError(f"max_seq_len: a whole number of {page}-position pages "
                         f"expected, got {max_seq_len}")
    if data.element_size() != 2:
        raise TypeError(f"data: a 16-bit cache expected, got {data.dtype}")
    kv = data[block_table[:, :max_seq_len // page]].view(num_reqs, max_seq_len, -1)
    scores = torch.bmm(q.view(num_reqs, num_heads, -1), kv.transpose(1, 2))
    scores = scores.float().mul_(softmax_scale)  # [B, N, C]
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores.sub_(lse.unsqueeze(-1))).to(q.dtype)
    out = torch.bmm(probs, kv[..., :kv_lora_rank])
    return out, lse.transpose(0, 1).contiguous()


def sdpa_baseline(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  causal: bool) -> tuple[float | None, str]:
    """(µs, label) of the fastest of PyTorch's cuDNN and flash SDPA on one sequence,
    q [T, N, Dqk], k [T, N, Dqk], v [T, N, Dv] (viewed as [1, N, T, D]), timed by
    `bench_covered`; (None, "unavailable") where neither runs. v is padded to the qk
    width when a backend needs equal widths (then the padded columns are extra work the
    baseline does, noted in the label)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    qt, kt, vt = (x.unsqueeze(0).transpose(1, 2) for x in (q, k, v))
    best, label = None, "unavailable"
    for backend, name in ((SDPBackend.CUDNN_ATTENTION, "cudnn"),
                          (SDPBackend.FLASH_ATTENTION, "flash")):
        for pad in (False, True):
            vv = vt
            if pad:
                if vt.shape[-1] == qt.shape[-1]:
                    continue
                vv = torch.nn.functional.pad(vt, (0, qt.shape[-1] - vt.shape[-1]))
            try:
                with sdpa_kernel([backend]):
                    torch.nn.functional.scaled_dot_product_attention(qt, kt, vv,
                                                                     is_causal=causal)
                    torch.cuda.synchronize()
                    us = bench_covered(
                        lambda vv=vv: torch.nn.functional.scaled_dot_product_attention(
                            qt, kt, vv, is_causal=causal), rep_ms=200)
            except RuntimeError:
                continue
            if best is None or us < best:
                best, label = us, f"SDPA {name}" + (" (v padded to qk width)" if pad else "")
            break
    return best, label
