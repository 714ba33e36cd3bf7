"""A probe kernel that records, per CTA, the tiles the device scheduler hands it (GPU test of the protocol).

record[cta, i, :] = the i-th work tile CTA `cta` got (all TILE_FIELDS), count[cta] = how many it got; the test
compares that with `Schedule.cta_work()`.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from .device import TileScheduler
from .problem import NUM_TILE_FIELDS, TILE_FIELDS


class SchedulerProbe:
    """Warp roles: one thread per CTA walks the scheduler. No pipelines, no shared memory."""

    def __init__(self, persistent: bool):
        self.persistent = persistent

    @cute.jit
    def __call__(self, table: cute.Tensor, num_tiles: Int32, record: cute.Tensor, count: cute.Tensor,
                 grid: Int32, stream):
        self.kernel(table, num_tiles, record, count).launch(grid=[grid, 1, 1], block=[32, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, table: cute.Tensor, num_tiles: Int32, record: cute.Tensor, count: cute.Tensor):
        tid, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        if tid == 0:
            sched = TileScheduler.create(table, num_tiles, self.persistent)
            work = sched.initial_work()
            n = Int32(0)
            while work.is_valid:
                work = sched.get_current_work(work)
                if n < record.shape[1]:
                    for f in cutlass.range_constexpr(NUM_TILE_FIELDS):
                        record[cta, n, f] = work.field(TILE_FIELDS[f])
                n = n + 1
                work = sched.advance(work)
            count[cta] = n


def compile_probe(persistent: bool, dump_dir=None):
    from cute_kernels.runtime.arch import import_cutlass
    from cute_kernels.runtime.compile import DYN, compile_kernel, fake_stream, fake_tensor

    def build():
        i32 = import_cutlass().Int32
        args = (
            fake_tensor(i32, (DYN, NUM_TILE_FIELDS), align=4),
            i32(1),
            fake_tensor(i32, (DYN, DYN, NUM_TILE_FIELDS), align=4),
            fake_tensor(i32, (DYN,), align=4),
            i32(1),
            fake_stream(),
        )
        return SchedulerProbe(persistent), args

    return compile_kernel(("scheduler_probe", persistent), build, dump_dir=dump_dir)


def run_probe(schedule, max_per_cta: int = 64):
    """Launch the probe for `schedule` on the current GPU; returns per-CTA lists of tile rows."""
    import torch

    table = schedule.table_on("cuda")
    ctas = schedule.grid[0]
    record = torch.full((ctas, max_per_cta, NUM_TILE_FIELDS), -1, dtype=torch.int32, device="cuda")
    count = torch.full((ctas,), -1, dtype=torch.int32, device="cuda")
    compiled = compile_probe(schedule.persistent)
    compiled.fn(table, schedule.num_tiles, record, count, ctas)
    record, count = record.cpu(), count.cpu()
    return [[tuple(record[c, i].tolist()) for i in range(min(int(count[c]), max_per_cta))] for c in range(ctas)], count


def probe_variants(Variant):
    return [
        Variant("scheduler_probe", f"scheduler_probe{'_persistent' if p else ''}",
                lambda d, p=p: compile_probe(p, dump_dir=d), ptx_must_have=("ld.global",))
        for p in (False, True)
    ]
