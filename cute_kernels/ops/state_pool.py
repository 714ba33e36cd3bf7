"""The chunked forward's state pool: `initial_state_indices` / `final_state_indices` (int32 [N]) into a pool
[P, HV, K, V] fp32 passed as `initial_state`. Sequence n starts from pool[initial_state_indices[n]] (-1: zeros);
its final state is written in place to pool[final_state_indices[n]] (-1: not written). The indices are read on
the device only (`kernels/state_pool.py`: a gather before the forward, a scatter after it), so a captured call
replays with new slots. A slot written by one sequence must not be read or written by another in the same call.
"""

from __future__ import annotations

import torch

from ..checks import check_tensor
from ..kernels.build import build_state_pool_copy


def check_pool(pool, N: int, HV: int, initial_state_indices, final_state_indices) -> None:
    if pool is None:
        raise ValueError("initial_state must be the state pool [P, HV, K, V] when state indices are given")
    check_tensor("initial_state", pool, dtypes=(torch.float32,), ndim=4)
    if pool.shape[1] != HV or tuple(pool.shape[2:]) != (128, 128):
        raise ValueError(f"initial_state (the pool) must be [P, HV = {HV}, 128, 128], got {tuple(pool.shape)}")
    for name, idx in (("initial_state_indices", initial_state_indices), ("final_state_indices", final_state_indices)):
        if idx is not None:
            check_tensor(name, idx, dtypes=(torch.int32,), ndim=1, align=4)
            if idx.shape[0] != N:
                raise ValueError(f"{name} must be [N = {N}] int32, got shape {tuple(idx.shape)}")
            if idx.device != pool.device:
                raise ValueError(f"{name} is on {idx.device} but the pool is on {pool.device}")


def gather_states(pool: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """[N, HV, K, V]: pool[idx[n]], zeros where idx[n] = -1."""
    dense = torch.empty((idx.shape[0],) + tuple(pool.shape[1:]), dtype=torch.float32, device=pool.device)
    if dense.numel():
        build_state_pool_copy(True).fn(dense, pool, idx)
    return dense


def scatter_states(dense: torch.Tensor, pool: torch.Tensor, idx: torch.Tensor) -> None:
    """pool[idx[n]] = dense[n] where idx[n] >= 0, in place."""
    if dense.numel():
        build_state_pool_copy(False).fn(dense, pool, idx)
