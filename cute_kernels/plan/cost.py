"""The cost model: predicted GPU time of each path of the chunked forward, from per-device measured costs
(`calibration.json`; docs/design.md, "The planner"): makespans of tiles on CTA slots, per-chunk, launch and merge-link
costs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from schedulers import Problem, SegmentCost, split_even
from schedulers.heuristics import makespan

# "auto" takes the two-phase path only where its prediction is under this fraction of the fused kernel's: within
# the model's error the fused kernel (one launch, no phase-1 terms in memory) is the safer choice.
TWO_PHASE_MARGIN = 0.95
# ... and the overlapped path only where its prediction is this far below the plain two-phase path's.
OVERLAP_MARGIN = 0.95
# Phase-1 tiles of 2-3 chunks balanced into one wave, where the makespan in chunk times drops by this factor.
PREP_BALANCE_GAIN = 0.9
# A state-pass tile's fixed cost (its first loads, the final state store) is charged only to tiles of at least
# this many chunks, and only where the output tiles take more than one wave.
STATE_TILE_MIN_CHUNKS = 4


@dataclass(frozen=True)
class Calibration:
    """One device's measured costs (`calibration.json`), us: per chunk per CTA, per launch, per merge link."""

    name: str
    source: str
    fused_chunk_us: dict
    fused_launch_us: dict
    prep_chunk_us: dict
    kda_folded_ratio: float
    state_chunk_us: dict
    state_tile_us: dict
    segment_us: dict
    merge_link_us: dict
    overlap_prep_chunk_us: dict
    overlap_chain_chunk_us: dict
    launch_us: float
    host_us: dict
    unmeasured: bool = False


@lru_cache(maxsize=None)
def calibration(device_name: str) -> Calibration:
    """The calibration of a device kind ("H100", "H200", "SM100"; anything else SM90-like takes the H200's)."""
    table = json.loads((Path(__file__).with_name("calibration.json")).read_text())
    name = device_name if device_name in table else "H200"
    entry = dict(table[name])
    base = dict(table[entry["same_as"]]) if "same_as" in entry else {}
    base.update({k: v for k, v in entry.items() if k != "same_as"})
    return Calibration(name=name, **base)


def op_key(kda: bool) -> str:
    return "kda" if kda else "gdn"


# ------------------------------------------------------------------ the fused path


def fused_segment_cost(cal: Calibration, kda: bool, link_us: float, init: bool) -> SegmentCost:
    """The fused kernel's costs for `schedulers.plan_segments_by_cost` (its segments: summary launch + merge +
    output launch)."""
    return SegmentCost(chunk_us=cal.fused_chunk_us[op_key(kda)], link_us=link_us, first_m=init)


# ------------------------------------------------------------------ the two-phase path: phase 1


def split_sizes(c: int, n: int) -> list[int]:
    """The chunk counts of `split_even(c, n)`'s pieces."""
    b = split_even(c, n)
    return [b[i + 1] - b[i] for i in range(len(b) - 1)]


def prep_base_ctas_per_sm(kda: bool) -> int:
    """Phase-1 CTAs per SM of the plain path's build before `prep_ctas_per_sm` raises it: GDN 2, KDA 1."""
    return 1 if kda else 2


def prep_ctas_per_sm(kda: bool, num_tiles: int, sms: int) -> int:
    """Phase-1 CTAs per SM for a grid of `num_tiles`: GDN 3 where two per SM would take more than one wave."""
    base = prep_base_ctas_per_sm(kda)
    return 3 if (not kda and num_tiles > base * sms) else base


def prep_chunks_per_tile(problem: Problem, kda: bool, sms: int) -> int:
    """1 when every chunk of the call gets its own CTA in one wave (a small call then waits for one chunk, not
    two), else 2 (the tile's second chunk loads under the first one's math)."""
    return 1 if sum(problem.chunks) * problem.num_heads <= sms * prep_base_ctas_per_sm(kda) else 2


def prep_tile_counts(problem: Problem, kda: bool, sms: int, chunks_per_tile: int | None = None,
                     balance: bool = True) -> list[int]:
    """Phase-1 tiles per sequence (each (sequence, head) split into that many near-equal chunk ranges).

    `chunks_per_tile` given: that many chunks per tile. Otherwise `prep_chunks_per_tile`'s, or with `balance`,
    where the makespan drops by PREP_BALANCE_GAIN: one wave of tiles, each sequence's share in proportion to its
    chunks."""
    H = problem.num_heads
    fixed = chunks_per_tile or prep_chunks_per_tile(problem, kda, sms)
    counts = [max(1, -(-c // fixed)) for c in problem.chunks]
    if chunks_per_tile is not None or not balance or fixed == 1:
        return counts
    total = sum(problem.chunks) * H
    wave = sms * prep_ctas_per_sm(kda, total, sms)   # total > one wave of tiles here: the largest occupancy
    share = [max(1, min(c, c * wave // total)) for c in problem.chunks]

    def span(ns):
        tiles = [n for c, k in zip(problem.chunks, ns) for n in split_sizes(c, k) for _ in range(H)]
        return makespan(tiles, sms * prep_ctas_per_sm(kda, len(tiles), sms))

    return share if span(share) <= PREP_BALANCE_GAIN * span(counts) else counts


def prep_chunk_us(cal: Calibration, kda: bool, ctas_per_sm: int, overlapped: bool = False) -> float:
    """Phase 1's time per chunk per CTA of the build that runs at `ctas_per_sm`."""
    if overlapped:
        return cal.overlap_prep_chunk_us[op_key(kda)] * (cal.kda_folded_ratio if kda else 1.0)
    if kda:
        return cal.prep_chunk_us["kda"] * cal.kda_folded_ratio
    return cal.prep_chunk_us["gdn_3_per_sm" if ctas_per_sm == 3 else "gdn_2_per_sm"]


# ------------------------------------------------------------------ the two-phase path: the whole call


def prep_us(cal: Calibration, problem: Problem, kda: bool, sms: int) -> float:
    """Phase 1's predicted time, launch included: its tiles as `prep_tile_counts` picks them without balancing
    (the model was fitted on unbalanced two-chunk tiles)."""
    H = problem.num_heads
    tile_counts = prep_tile_counts(problem, kda, sms, balance=False)
    prep = [n for c, k in zip(problem.chunks, tile_counts) for _ in range(H) for n in split_sizes(c, k)]
    per_sm = prep_ctas_per_sm(kda, len(prep), sms)
    return makespan(prep, sms * per_sm) * prep_chunk_us(cal, kda, per_sm) + cal.launch_us


def two_phase_us(cal: Calibration, problem: Problem, counts, kda: bool, init: bool, sms: int, link_us: float,
                 phase1_us: float | None = None) -> float:
    """Predicted GPU time of the two-phase forward with `counts` segments per sequence (`problem`: one block).

    Phase 1: `prep_us` (or `phase1_us`, computed once by a caller trying many counts). Phase 2: output tiles; if
    split, summary tiles, N - 1 merge links (and the per-segment cost) and two more launches."""
    key = op_key(kda)
    H = problem.num_heads
    t = prep_us(cal, problem, kda, sms) if phase1_us is None else phase1_us
    lens = [split_sizes(c, max(1, min(n, c))) for c, n in zip(problem.chunks, counts)]
    chunk_us = cal.state_chunk_us[key]
    tile = cal.state_tile_us[key] / chunk_us if sum(len(ls) for ls in lens) * 2 * H > sms else 0.0
    outputs = [n + (tile if c >= STATE_TILE_MIN_CHUNKS else 0.0)
               for c, ls in zip(problem.chunks, lens) for n in ls for _ in range(2 * H)]
    t += makespan(outputs, sms) * chunk_us
    if all(len(ls) <= 1 for ls in lens):
        return t
    summary = [n for ls in lens for s, n in enumerate(ls[:-1]) for _ in range(H * 2 * (2 if (s or init) else 1))]
    t += makespan(summary, sms) * chunk_us
    return t + (max(len(ls) for ls in lens) - 1) * (link_us + cal.segment_us[key]) + 2 * cal.launch_us


def two_phase_segments(cal: Calibration, problem: Problem, kda: bool, init: bool, sms: int, link_us: float,
                       min_chunks: int = 2) -> int:
    """The segment count (the same for every sequence, capped by each one's chunks) that `two_phase_us` likes
    best; ties go to fewer segments. The search stops once a lower bound of every larger count's time (phase 1,
    the state chunks spread evenly over the SMs, the merge links) passes the best time: it only grows with N."""
    key = op_key(kda)
    H = problem.num_heads
    cap = max(1, max(problem.chunks, default=1) // min_chunks)
    phase1 = prep_us(cal, problem, kda, sms)
    best, best_t = 1, two_phase_us(cal, problem, [1] * problem.num_seqs, kda, init, sms, link_us, phase1)
    for n in range(2, cap + 1):
        # state chunks spread evenly over the SMs, plus links and launches: a bound that never shrinks as n grows
        lens = [split_sizes(c, max(1, min(n, c))) for c in problem.chunks]
        work = sum(sum(ls) + sum(x * (2 if (s or init) else 1) for s, x in enumerate(ls[:-1])) for ls in lens)
        bound = (phase1 + work * 2 * H * cal.state_chunk_us[key] / sms
                 + (max(len(ls) for ls in lens) - 1) * (link_us + cal.segment_us[key]) + 2 * cal.launch_us)
        if bound >= best_t * 0.999:
            break
        t = two_phase_us(cal, problem, [n] * problem.num_seqs, kda, init, sms, link_us, phase1)
        if t < best_t * 0.999:
            best, best_t = n, t
    return best


# ------------------------------------------------------------------ the overlapped path


def overlap_fits(B: int, H: int, sms: int) -> bool:
    """Whether the overlapped path may run: its state CTAs (two per (sequence, head)) leave at least half the SMs
    to phase 1 (below that phase 1 on the rest is slower than the two phases in turn anyway)."""
    return 0 < 2 * B * H <= sms // 2


def overlap_prep_ctas(sms: int, state_ctas: int) -> int:
    """Phase-1 CTAs of the overlapped path (before the cap at its tile count): one per SM the state pass leaves."""
    return max(1, sms - state_ctas)


def overlap_us(cal: Calibration, problem: Problem, kda: bool, sms: int) -> float:
    """Predicted GPU time of the overlapped path (fixed length, one segment): max(phase 1 on the SMs the state CTAs
    leave + the last chunk's chain step, first chunk + the chain), per-chunk costs as measured with both running."""
    H = problem.num_heads
    free = overlap_prep_ctas(sms, 2 * problem.num_seqs * H)
    prep_us, chunk_us = prep_chunk_us(cal, kda, 1, overlapped=True), cal.overlap_chain_chunk_us[op_key(kda)]
    t_prep = makespan([1] * (sum(problem.chunks) * H), free) * prep_us
    t_chain = max(problem.chunks) * chunk_us
    return max(t_prep + chunk_us, prep_us + t_chain) + 2 * cal.launch_us


# ------------------------------------------------------------------ host time of an eager call


def host_us(cal: Calibration, two_phase: bool, launches: int) -> float:
    """The host's time per eager call of one path with `launches` kernel launches."""
    base = cal.host_us["two_phase" if two_phase else "fused"]
    return base + cal.host_us["per_extra_launch"] * (launches - (2 if two_phase else 1))
