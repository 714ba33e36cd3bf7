"""Tensor views the kernels make inside `__call__` (every arch): the ops pass their tensors as they are, so no view
is made on the host's per-call path."""

from __future__ import annotations

import cutlass.cute as cute


def flat(t):
    """[B, T, ...] -> [B * T, ...]: the ops pass contiguous tensors, so B's stride is T times T's."""
    return cute.make_tensor(
        t.iterator,
        cute.make_layout((t.shape[0] * t.shape[1],) + tuple(t.shape[2:]), stride=(t.stride[1],) + tuple(t.stride[2:])),
    )


def thd(t):
    """A [tokens, H, D] tensor as (tokens, D, H): per-head 2-D (token, channel) tiles, as TMA loads them."""
    return cute.make_tensor(
        t.iterator,
        cute.make_layout((t.shape[0], t.shape[2], t.shape[1]), stride=(t.stride[0], t.stride[2], t.stride[1])),
    )


def dth(t):
    """A [tokens, H, D] tensor as (D, tokens, H): the channel-major (MN-major) view of the same tiles."""
    return cute.make_tensor(
        t.iterator,
        cute.make_layout((t.shape[2], t.shape[0], t.shape[1]), stride=(t.stride[2], t.stride[0], t.stride[1])),
    )
