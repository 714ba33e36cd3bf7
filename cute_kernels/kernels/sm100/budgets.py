"""SM100 per-CTA budgets, checked on the host before a build (plain Python, no CuTe DSL): shared memory (227 KB a
CTA, 228 KB an SM) and tensor memory (512 columns of 128 lanes an SM, allocated per CTA in powers of two >= 32).
"""

from __future__ import annotations

from dataclasses import dataclass

SMEM_PER_CTA = 232448   # 227 KB
SMEM_PER_SM = 233472    # 228 KB
SMEM_RESERVED_PER_CTA = 1024
TMEM_COLUMNS = 512


@dataclass(frozen=True)
class TmemPlan:
    """A CTA's tensor-memory columns: `regions` (name, first column, width) laid out in order, `alloc` columns
    allocated (what tcgen05.alloc takes: a power of two >= 32), `ctas_per_sm` CTAs sharing the SM's 512."""

    regions: tuple[tuple[str, int, int], ...]
    alloc: int
    ctas_per_sm: int

    def col(self, name: str) -> int:
        """The first column of region `name`."""
        for region, first, _ in self.regions:
            if region == name:
                return first
        raise KeyError(f"no TMEM region {name!r} (regions: {[r for r, _, _ in self.regions]})")


def tmem_plan(widths: dict[str, int], ctas_per_sm: int) -> TmemPlan:
    """Regions of `widths` columns one after another; raises ValueError if `ctas_per_sm` CTAs overrun the SM."""
    if ctas_per_sm < 1 or any(w < 1 for w in widths.values()):
        raise ValueError(f"ctas_per_sm and every width must be >= 1, got {ctas_per_sm}, {widths}")
    regions, first = [], 0
    for name, width in widths.items():
        regions.append((name, first, width))
        first += width
    alloc = max(32, 1 << (first - 1).bit_length())
    if alloc * ctas_per_sm > TMEM_COLUMNS:
        raise ValueError(f"TMEM: {ctas_per_sm} CTAs x {alloc} columns ({first} used) exceed the SM's {TMEM_COLUMNS}")
    return TmemPlan(tuple(regions), alloc, ctas_per_sm)


def check_smem(nbytes: int, ctas_per_sm: int, what: str) -> None:
    """Raises ValueError if a CTA of `nbytes` shared memory, `ctas_per_sm` to an SM, does not fit."""
    if nbytes > SMEM_PER_CTA:
        raise ValueError(f"{what}: shared memory {nbytes} B exceeds the {SMEM_PER_CTA} B of a CTA")
    if ctas_per_sm * (nbytes + SMEM_RESERVED_PER_CTA) > SMEM_PER_SM:
        raise ValueError(f"{what}: {ctas_per_sm} CTAs x {nbytes} B (+{SMEM_RESERVED_PER_CTA} reserved each) exceed "
                         f"the {SMEM_PER_SM} B of an SM")


def fused_tmem_plan() -> TmemPlan:
    """`ChunkedForwardSm100`'s columns (one CTA per SM): S [dk lanes x dv] 128, A = [k; q] k^T 64, KQS = S^T [k; q]^T
    (k S then q S, transposed) 128, VN = v_new^T 64, O = v_new^T Aqk^T 64: 448 used, 512 allocated."""
    return tmem_plan({"s": 128, "a": 64, "kqs": 128, "vn": 64, "o": 64}, ctas_per_sm=1)


KDA_BANDS = (64, 48, 32, 16)        # KDA: tokens (rows of the right factors, columns of A) of band delta = 0..3
KDA_BAND_ROWS = (0, 64, 112, 144)   # each band's first row in the kernel's 160-row shared-memory tile
KDA_BAND_COLS = (0, 64, 128, 160)   # each band's first TMEM column in region "a"


def fused_kda_tmem_plan() -> TmemPlan:
    """`ChunkedForwardSm100`'s KDA columns: S 128; the four intra bands A_delta (N = 64, 48, 32, 16) at columns
    a + `KDA_BAND_COLS` (176: band 1 padded to 64 so that every band starts at a multiple of 32; v_new^T and O
    reuse a + 0 and a + 64 once the bands are read); KQS 128: 432 used, 512 allocated."""
    return tmem_plan({"s": 128, "a": 176, "kqs": 128}, ctas_per_sm=1)


def fused_kda_smem_bytes() -> int:
    """`ChunkedForwardSm100`'s KDA shared memory (its struct's fields, before alignment; the struct is 222 KB), one
    q / k / v stage: raw [k; q] and v; the left factors [kl; ql] (the gate values G in fp32 once they are read),
    the gated [kg; qg] and kb; the four right bands (160 rows; Akk fp32, Aqk, Xv and the solve's buffer reuse them
    once the bands are read); S in bf16; U / v_new^T; the gate scan's exchange (rows 0-31's totals, block
    anchors, G_L); beta, a flag and the barriers."""
    tile = 64 * 128 * 2                                      # a 64-token x 128-channel 16-bit tile
    bands = (64 + 48 + 32 + 16) * 128 * 2
    reused = 64 * 68 * 4 + 64 * 64 * 2 * 2 + 32 * 40 * 4     # Akk (fp32, padded rows), Aqk, Xv, the solve's Y
    assert reused <= bands
    return 2 * tile + tile + 2 * tile + 2 * tile + tile + bands + 2 * tile + tile + (2 + 4) * 128 * 4 + 64 * 4 + 512
