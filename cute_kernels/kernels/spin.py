"""Waits on counters in global memory (every arch's kernels): bounded, so a wait that can never end fails loudly.

The look-back state pass, the overlapped path (`consume`) and the one-pass forward's early correction spin on
counts that other CTAs (or another grid) publish with release semantics. If a publisher never comes -- a protocol
bug, a launch that could not start beside a spinning grid -- an unbounded spin hangs the process. Here a waiting
thread counts its acquire loads and executes `trap` after SPIN_LIMIT of them (seconds of waiting, far beyond any
real wait in these kernels: those last at most one launch of the other grid), so the launch fails with an error
instead ("unspecified launch failure"; the CUDA context is then unusable, as after any trap).
Bounded: every wait of the early correction and of `consume`, the look-back's producer wait on a summary count and
its consumer wait on the predecessor's end flag. The look-back consumer's own look at the summary count stays a
plain loop (a counter there made ptxas spill), but it comes after the producer's bounded wait on the same count.
"""

from __future__ import annotations

import cutlass.cute as cute
from cutlass import Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op

SPIN_LIMIT = 1 << 24   # acquire loads (~0.5-1 us each) before a wait is declared stuck: ~8-16 s


@dsl_user_op
def trap(*, loc=None, ip=None) -> None:
    """PTX `trap`: abort the kernel; the launch reports an error."""
    llvm.inline_asm(
        res=None,
        operands_=[],
        asm_string="trap;",
        constraints="~{memory}",
        has_side_effects=True,
        asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc,
        ip=ip,
    )


@cute.jit
def count_spin(spins) -> Int32:
    """One more look of a spin loop: `spins + 1`, trapping once it passes SPIN_LIMIT."""
    spins = spins + 1
    if spins > SPIN_LIMIT:
        trap()
    return spins


@cute.jit
def wait_at_least(ptr, need) -> Int32:
    """One thread: gpu-scope acquire loads of the int32 at `ptr` (a global pointer) until it is >= `need`;
    returns the value seen. Traps after SPIN_LIMIT loads."""
    seen = cute.arch.load(ptr, Int32, sem="acquire", scope="gpu")
    spins = Int32(0)
    while seen < need:
        spins = count_spin(spins)
        seen = cute.arch.load(ptr, Int32, sem="acquire", scope="gpu")
    return seen


@cute.jit
def wait_nonzero(ptr) -> Int32:
    """`wait_at_least(ptr, 1)` for a flag that is set, not counted."""
    return wait_at_least(ptr, Int32(1))

