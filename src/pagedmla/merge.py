"""Public log-sum-exp merge of two partial attention results."""

from __future__ import annotations

import torch

from pagedmla.ops.registry import get_backend


def _check(name: str, tensor: object, shape: tuple[int, ...], device: torch.device) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tuple(tensor.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(tensor.shape)}")
    if tensor.device != device:
        raise ValueError(f"{name} must be on {device}, got {tensor.device}")


def merge_attn_states(
    prefix_output: torch.Tensor,
    prefix_lse: torch.Tensor,
    suffix_output: torch.Tensor,
    suffix_lse: torch.Tensor,
    output: torch.Tensor | None = None,
    output_lse: torch.Tensor | None = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two softmax partials over disjoint keys: outputs [T, N, D], lse [N, T].

    out = (e^lse_p * out_p + e^lse_s * out_s) / (e^lse_p + e^lse_s), lse = log of the
    denominator. An lse of -inf (or +inf, which some kernels report for rows with no
    key) marks an empty partial; merging with an empty partial returns the other one,
    two empties give output 0 and lse -inf. Results go to `output` (floating point:
    the merge is computed in float32 and rounded once to its dtype) and `output_lse`
    (float32) when given (they may alias the inputs) and are returned.
    """
    if not isinstance(prefix_output, torch.Tensor):
        raise TypeError(f"prefix_output must be a torch.Tensor, got {type(prefix_output).__name__}")
    if prefix_output.dim() != 3:
        raise ValueError(f"prefix_output must be [T, N, D], got shape {tuple(prefix_output.shape)}")
    if not prefix_output.is_floating_point():
        raise TypeError(f"prefix_output must be floating point, got {prefix_output.dtype}")
    T, N, D = prefix_output.shape
    device = prefix_output.device
    _check("suffix_output", suffix_output, (T, N, D), device)
    for name, lse in (("prefix_lse", prefix_lse), ("suffix_lse", suffix_lse)):
        _check(name, lse, (N, T), device)
        if lse.dtype != torch.float32:
            raise TypeError(f"{name} must be float32, got {lse.dtype}")
    if suffix_output.dtype != prefix_output.dtype:
        raise TypeError(
            f"suffix_output dtype {suffix_output.dtype} must match prefix_output dtype "
            f"{prefix_output.dtype}"
        )
    if output is None:
        output = torch.empty_like(prefix_output)
    else:
        _check("output", output, (T, N, D), device)
        if not output.is_floating_point():
            raise TypeError(f"output must be floating point, got {output.dtype}")
    if output_lse is None:
        output_lse = torch.empty(N, T, dtype=torch.float32, device=device)
    else:
        _check("output_lse", output_lse, (N, T), device)
        if output_lse.dtype != torch.float32:
            raise TypeError(f"output_lse must be float32, got {output_lse.dtype}")
    get_backend(backend, device).merge_attn_states(
        prefix_output, prefix_lse, suffix_output, suffix_lse, output, output_lse
    )
    return output, output_lse
