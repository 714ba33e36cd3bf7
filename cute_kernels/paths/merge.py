"""The affine merge as the paths run it: one compiled variant and its launch, built once per configuration."""

from __future__ import annotations

import torch

from ..kernels.build import build_affine_merge
from ..kernels.configs import MergeConfig


class MergeStarts:
    """`affine_merge(..., starts_only=True)` for one fixed configuration (K = V = 128), checked and compiled once:
    `run(M, h_ext, initial_state) -> start_states` launches unchecked (on buffers the segmented paths made).
    `pdl`: launched with programmatic dependent launch after the summary launch (it waits for it inside)."""

    def __init__(self, impl: str, num_seqs: int, num_heads: int, slots: int, offsets: torch.Tensor,
                 has_initial_state: bool, device, pdl: bool):
        self.config = MergeConfig(impl, 128, 128, has_initial_state, starts_only=True, pdl=pdl)
        self.fn = build_affine_merge(self.config).fn
        self.num_seqs, self.num_heads, self.slots = num_seqs, num_heads, slots
        self.offsets, self.device = offsets, device

    def run(self, M, h_ext, initial_state):
        starts = torch.empty((self.slots, self.num_heads, 128, 128), dtype=torch.float32, device=self.device)
        unused = starts[:self.num_seqs]   # stands in for the final state (and the initial state when there is none)
        self.fn(M, h_ext, self.offsets, initial_state if self.config.initial_state else unused, starts, unused)
        return starts
