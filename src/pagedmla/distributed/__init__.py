"""Tensor parallelism and decode context parallelism on torch.distributed.

state.py         ParallelState: ranks, sizes, process groups, collectives
tensor_parallel  a rank's share of a model, and how its loader reads it (layers.py: the
                 parallel modules)
dcp_layout       which rank holds which token's latent row
dcp_metadata     per-rank attention metadata (dcp_attention: the collectives it adds)
launch / runtime starting the ranks, serving steps (channel.py), stopping cleanly
"""

from pagedmla.distributed.dcp_layout import DCPLayout
from pagedmla.distributed.state import ParallelState, check_parallel_sizes

__all__ = ["DCPLayout", "ParallelState", "check_parallel_sizes"]
