"""The fused forward: one kernel per (sequence, head[, segment]) walks its chunks, doing each chunk's local work
and the state update together (docs/design.md, "The paths"). Split into segments: a summary launch (each
segment's affine map from 0 / I), the affine merge into true start states, and the segments' outputs."""

from __future__ import annotations

import torch

from schedulers import Schedule
from schedulers.host import sequence_table_on_device

from ..checks import offsets_tensor
from ..kernels.build import build_fused
from ..kernels.configs import FusedConfig, GateForm
from .merge import MergeStarts


class FusedRun:
    """The fused path of one configuration, built once: compiled kernels, tile tables on the device and, if
    segmented, the merge. `run` launches, unchecked (the op has validated its inputs). `num_heads`: value heads
    (the work tiles'); `group`: value heads per q / k head (GVA); `gate`: the builds' `GateForm` (`run` takes the
    launch's (a_log, dt_bias, lower_bound))."""

    poison = False   # tests: the summary buffer starts as NaN (an unwritten slot that is read shows)

    def __init__(self, kda: bool, num_heads: int, schedule: Schedule, summary: Schedule | None, merge_impl: str, io,
                 beta_dtype, init: bool, final: bool, device, group: int = 1, gate: GateForm = GateForm()):
        self.schedule, self.summary, self.init, self.device = schedule, summary, init, device
        self.num_heads = num_heads
        self.table = schedule.table_on(device)
        self.dummy = None if final else torch.empty((1, 1, 128, 128), dtype=torch.float32, device=device)
        if summary is None:
            self.fn = build_fused(FusedConfig(kda, "forward", init, final, schedule.persistent, group, gate), io,
                                  beta_dtype).fn
            return
        self.slots = schedule.segmentation.total_segments
        self.summary_fn = (build_fused(FusedConfig(kda, "summary", group=group, gate=gate), io, beta_dtype).fn
                           if summary.num_tiles else None)
        self.summary_table = summary.table_on(device)
        self.fn = build_fused(FusedConfig(kda, "segment_outputs", True, final, group=group, gate=gate), io,
                              beta_dtype).fn
        n = len(schedule.seg_offsets) - 1
        offsets, _ = offsets_tensor("seg_offsets", schedule.seg_offsets, self.slots, device)
        self.merge = MergeStarts(merge_impl, n, num_heads, self.slots, offsets, init, device, pdl=False)

    def run(self, q, k, v, g32, beta, scale: float, initial_state, o, final, gate):
        args = (q, k, v, g32, beta, *gate, o)   # 4-D / 3-D as given: the kernel flattens B and T itself
        dummy = final if final is not None else self.dummy
        s = self.schedule
        if self.summary is None:
            self.fn(*args, initial_state if self.init else dummy, dummy, self.table, s.num_tiles, s.grid[0], scale)
            return
        summary = torch.empty((2 * self.slots, self.num_heads, 128, 128), dtype=torch.float32, device=self.device)
        if self.poison:
            summary.fill_(float("nan"))
        if self.summary_fn is not None:
            self.summary_fn(*args, summary, summary, self.summary_table, self.summary.num_tiles,
                            self.summary.grid[0], scale)
        starts = self.merge.run(summary[self.slots:], summary[:self.slots], initial_state)
        self.fn(*args, starts, dummy, self.table, s.num_tiles, s.num_tiles, scale)


class DeviceTableRun:
    """The fused path for graph-capturable varlen calls: the tile table (one tile per (sequence, head), whole
    sequences) is built on the device from `cu_seqlens` at every call, so nothing of a call is read on the host and
    a captured call replays with new lengths. No segments: each (sequence, head) is one CTA's walk."""

    def __init__(self, kda: bool, num_heads: int, io, beta_dtype, init: bool, final: bool, device, group: int = 1,
                 gate: GateForm = GateForm()):
        self.num_heads, self.init = num_heads, init
        self.fn = build_fused(FusedConfig(kda, "forward", init, final, False, group, gate), io, beta_dtype).fn
        self.dummy = None if final else torch.empty((1, 1, 128, 128), dtype=torch.float32, device=device)

    def run(self, q, k, v, g32, beta, scale: float, initial_state, o, final, gate, cu_seqlens):
        table = sequence_table_on_device(cu_seqlens, self.num_heads)
        tiles = table.shape[0]
        dummy = final if final is not None else self.dummy
        self.fn(q, k, v, g32, beta, *gate, o, initial_state if self.init else dummy, dummy, table, tiles, tiles,
                scale)
