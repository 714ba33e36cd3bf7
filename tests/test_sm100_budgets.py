"""SM100 host-side budgets (plain Python, no GPU, no CuTe DSL): tensor-memory column plans and shared memory."""

import pytest

from cute_kernels.kernels.sm100.budgets import SMEM_PER_CTA, TMEM_COLUMNS, check_smem, tmem_plan


def test_decode_tmem_plan():
    """The decode kernel's columns: S (32) then O (128), 256 allocated, two CTAs per SM in the 512."""
    plan = tmem_plan({"s": 32, "o": 128}, ctas_per_sm=2)
    assert plan.regions == (("s", 0, 32), ("o", 32, 128))
    assert (plan.col("s"), plan.col("o"), plan.alloc) == (0, 32, 256)
    assert plan.alloc * plan.ctas_per_sm == TMEM_COLUMNS
    with pytest.raises(ValueError, match="3 CTAs x 256 columns"):
        tmem_plan({"s": 32, "o": 128}, ctas_per_sm=3)
    with pytest.raises(KeyError, match="no TMEM region 'p'"):
        plan.col("p")


@pytest.mark.parametrize("widths, alloc", [({"d": 64}, 64), ({"a": 1}, 32), ({"a": 33}, 64), ({"a": 100, "b": 29}, 256),
                                           ({"a": 512}, 512)])
def test_tmem_alloc_is_a_power_of_two_of_at_least_32(widths, alloc):
    plan = tmem_plan(widths, ctas_per_sm=1)
    assert plan.alloc == alloc
    assert sum(w for _, _, w in plan.regions) <= plan.alloc


def test_tmem_plan_rejects_overruns_and_bad_input():
    with pytest.raises(ValueError, match="exceed the SM's 512"):
        tmem_plan({"o": 513}, ctas_per_sm=1)
    with pytest.raises(ValueError, match="2 CTAs x 512 columns"):
        tmem_plan({"s": 64, "o": 256}, ctas_per_sm=2)
    with pytest.raises(ValueError, match="must be >= 1"):
        tmem_plan({"s": 0}, ctas_per_sm=1)


def test_smem_budget():
    """A CTA may take 227 KB; CTAs on one SM share 228 KB, with 1 KB reserved for each."""
    decode = 1024 + 2 * (128 * 128 + 2 * 4 * 32 * 128 + 128 * 32)   # barriers, Q, 4-stage K / V ring, P (bf16)
    assert decode == 107520
    check_smem(decode, 2, "decode")
    check_smem(SMEM_PER_CTA, 1, "one CTA")
    with pytest.raises(ValueError, match="decode: 2 CTAs"):
        check_smem(decode + 9 * 1024, 2, "decode")
    with pytest.raises(ValueError, match="exceeds the 232448 B of a CTA"):
        check_smem(SMEM_PER_CTA + 1, 1, "big")


def test_fused_tmem_plan():
    """The fused GDN kernel's columns: S, the intra products, (k S, q S)^T, v_new^T, O: 448 of 512, one CTA per SM."""
    from cute_kernels.kernels.sm100.budgets import fused_tmem_plan

    plan = fused_tmem_plan()
    assert plan.regions == (("s", 0, 128), ("a", 128, 64), ("kqs", 192, 128), ("vn", 320, 64), ("o", 384, 64))
    assert (plan.alloc, plan.ctas_per_sm) == (512, 1)
    with pytest.raises(ValueError, match="2 CTAs x 512 columns"):
        tmem_plan(dict((name, width) for name, _, width in plan.regions), ctas_per_sm=2)


def test_kda_plan_fits():
    """`ChunkedForwardSm100`'s KDA budgets: 432 of 512 TMEM columns, the four bands inside region "a" at
    32-aligned columns with v_new^T and O (64 each) over its first 128; about 220 KB of shared memory, one CTA
    per SM; a second q / k / v stage (48 KB more) would not fit."""
    from cute_kernels.kernels.sm100.budgets import KDA_BAND_COLS, fused_kda_smem_bytes, fused_kda_tmem_plan

    plan = fused_kda_tmem_plan()
    assert plan.regions == (("s", 0, 128), ("a", 128, 176), ("kqs", 304, 128)) and plan.alloc == 512
    bands = (64, 48, 32, 16)
    assert all(first % 32 == 0 and first + n <= 176 for first, n in zip(KDA_BAND_COLS, bands))
    assert all(KDA_BAND_COLS[i] + bands[i] <= KDA_BAND_COLS[i + 1] for i in range(3)) and 2 * 64 <= 176
    nbytes = fused_kda_smem_bytes()
    assert 215 * 1024 <= nbytes <= SMEM_PER_CTA
    check_smem(nbytes, 1, "KDA")
    with pytest.raises(ValueError, match="exceeds"):
        check_smem(nbytes + 48 * 1024, 1, "KDA, two stages")