"""Bounded waits on counters in global memory (every arch's kernels): a wait that can never end fails loudly.
A waiting thread counts its acquire loads and executes `trap` after SPIN_LIMIT of them (far beyond any real wait),
so the launch fails ("unspecified launch failure"; the CUDA context is then unusable) instead of hanging.
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
