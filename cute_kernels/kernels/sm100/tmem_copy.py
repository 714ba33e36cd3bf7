"""tcgen05.ld / st of a 128-lane TMEM accumulator, 32 (or 16) fp32 columns at a time, for the SM100 kernels'
elementwise warps (thread t of a warpgroup reads and writes lane t)."""

from __future__ import annotations

import cutlass.cute as cute
from cutlass import Float32
from cutlass.cute.nvgpu import tcgen05


def column_copies(cols: cute.Tensor, thread, n: int = 32):
    """(ld, st, this thread's ld slice, its st slice) for (128 lanes, n columns) TMEM views shaped as `cols`."""
    rep = {16: tcgen05.Repetition.x16, 32: tcgen05.Repetition.x32}[n]
    ld = tcgen05.make_tmem_copy(cute.make_copy_atom(tcgen05.Ld32x32bOp(rep), Float32), cols)
    st = tcgen05.make_tmem_copy(cute.make_copy_atom(tcgen05.St32x32bOp(rep), Float32), cols)
    return ld, st, ld.get_slice(thread), st.get_slice(thread)
