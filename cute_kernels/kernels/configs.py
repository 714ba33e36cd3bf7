"""Compile-time options of every kernel, as frozen configs: the planner picks them, the kernel classes take them in
`__init__`, the compile cache keys on them. Plain Python (no CuTe DSL import). Only the combinations each config's
`check` lists are built (and tested); anything else raises, naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass

MODES = ("forward", "summary", "segment_outputs")
MERGE_IMPLS = ("staged", "prefetch", "regs", "tc")
# affine merge: impl -> (threads per CTA, V columns per CTA)
MERGE_SHAPES = {"staged": (256, 32), "prefetch": (256, 8), "regs": (256, 8), "tc": (256, 64)}


def _mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")


def _gate(gate, kda: bool) -> None:
    if not isinstance(gate, GateForm):
        raise ValueError(f"gate must be a GateForm, got {gate!r}")
    if gate.g == "bounded" and not kda:
        raise ValueError("the bounded gate (lower_bound) is KDA's")


def _group(group: int) -> None:
    if not isinstance(group, int) or group < 1:
        raise ValueError(f"group (value heads per q / k head) must be an int >= 1, got {group!r}")


GATE_FORMS = ("log", "softplus", "bounded")
BETA_FORMS = ("value", "sigmoid", "sigmoid2")


@dataclass(frozen=True)
class GateForm:
    """How the chunked kernels read g and beta: FLA's gate arguments applied as each value is loaded.
    g: "log" (the log decay as given), "softplus" (use_gate_in_kernel: g = -A softplus(x)), "bounded" (KDA's
    lower_bound: g = lower_bound sigmoid(A x)); x = g + dt_bias (with `dt_bias`: per head, KDA per (head, key));
    A = exp(A_log[head]) with `a_log`, else 1. beta: "value", "sigmoid" (use_beta_sigmoid_in_kernel), "sigmoid2"
    (and allow_neg_eigval: 2 sigmoid). Rows past a sequence's end keep g = 0 and beta = 0."""

    g: str = "log"
    a_log: bool = False
    dt_bias: bool = False
    beta: str = "value"

    def __post_init__(self):
        if self.g not in GATE_FORMS:
            raise ValueError(f"gate form g must be one of {GATE_FORMS}, got {self.g!r}")
        if self.beta not in BETA_FORMS:
            raise ValueError(f"gate form beta must be one of {BETA_FORMS}, got {self.beta!r}")
        if self.g == "log" and (self.a_log or self.dt_bias):
            raise ValueError("a_log / dt_bias belong to the in-kernel gate forms (g 'softplus' or 'bounded')")
        if self.g == "softplus" and not self.a_log:
            raise ValueError("the softplus gate needs a_log")


@dataclass(frozen=True)
class FusedConfig:
    """The fused forward (`ChunkedForwardSm90`): one CTA per (sequence, head[, segment]) walks its chunks.
    mode: `forward` (start from the initial state or 0, write o and, at a sequence's last segment, the final
    state), `summary` (the segment's affine map from 0 / I, no o), `segment_outputs` (start from the merged start
    state of the segment's slot, write o). persistent: CTAs loop over the tile table (PersistentScheduler).
    group: value heads per q / k head (GVA): the work tile's head hv reads q and k at hv // group.
    gate: `GateForm`, how g and beta are read (FLA's gate arguments, applied at the load)."""

    kda: bool = False
    mode: str = "forward"
    initial_state: bool = False
    final_state: bool = False
    persistent: bool = False
    group: int = 1
    gate: GateForm = GateForm()

    def __post_init__(self):
        _mode(self.mode)
        _group(self.group)
        _gate(self.gate, self.kda)


@dataclass(frozen=True)
class PrepConfig:
    """Phase 1 of the two-phase forward (`ChunkPrepSm90`): every chunk's local terms, in parallel.
    terms: `folded` -- T = (I + Akk)^-1 diag(beta) folded into the products that read v_new: W2 = T^T kg and
    A1 = Aqk T (no v load; GDN writes no gated q / k either, the state pass scales q, k by per-token factors);
    `solved` -- w = T exp(G) k, u = T v, Aqk and the gated q, k (GDN's overlapped path).
    ctas_per_sm: GDN's folded build runs 2 or 3 CTAs per SM (3: Akk over the dead q tile, for grids past one
    wave of 2); every other build 1. publish: the overlapped path's build (persistent grid, a flag per chunk).
    pdl: programmatic dependent launch: the state pass's prologue overlaps this grid's tail. group: GVA, as
    `FusedConfig` (the terms are per value head). gate: `GateForm`, as `FusedConfig`."""

    kda: bool = False
    terms: str = "folded"
    ctas_per_sm: int = 2
    publish: bool = False
    pdl: bool = True
    group: int = 1
    gate: GateForm = GateForm()

    def __post_init__(self):
        _group(self.group)
        _gate(self.gate, self.kda)
        if self.terms not in ("folded", "solved"):
            raise ValueError(f"terms must be 'folded' or 'solved', got {self.terms!r}")
        built = ((self.kda and self.terms == "folded" and self.ctas_per_sm == 1)
                 or (not self.kda and self.terms == "folded" and self.ctas_per_sm in (2, 3) and not self.publish)
                 or (not self.kda and self.terms == "solved" and self.ctas_per_sm == 1 and self.publish))
        if not built:
            raise ValueError(f"no phase-1 build for {self}: KDA is folded at ctas_per_sm=1; GDN folded at 2 or 3 "
                             f"(not publish), GDN solved at 1 with publish")

    @property
    def tma_store(self) -> bool:
        """KDA's full chunks leave by TMA stores (the overlapped build publishes after thread stores instead)."""
        return self.kda and not self.publish


@dataclass(frozen=True)
class StateConfig:
    """Phase 2 (`ChunkStatePassSm90`): only the state recurrence, one CTA per (sequence, head, 64 V columns, segment),
    the chain in registers. token_factors: GDN's folded terms -- q, k, v, W2, A1 and per-token factors (scale 2^G,
    2^(G_L - G), 2^G_L, 2^G) -- instead of the solved terms (qg, w, u, kg, Aqk, exp(G_L)); KDA always reads the
    solved slots (its folded terms fill them: exp(G) k, v, W2, A1). consume: the overlapped path's build (waits on
    phase 1's per-chunk flags). pdl: waits for the previous kernel inside, after its prologue. group: GVA (with
    token_factors, q and k are the call's, read at hv // group; every other term is per value head)."""

    kda: bool = False
    mode: str = "forward"
    initial_state: bool = False
    final_state: bool = False
    token_factors: bool = False
    consume: bool = False
    pdl: bool = True
    group: int = 1

    def __post_init__(self):
        _mode(self.mode)
        _group(self.group)
        if self.group != 1 and not self.token_factors:
            raise ValueError("group: only the token_factors build reads q / k (the solved terms are per value head)")
        if self.token_factors and self.kda:
            raise ValueError("token_factors is GDN's folded build (KDA's folded terms fill the solved slots)")
        if self.consume and (self.mode != "forward" or self.token_factors):
            raise ValueError("consume (the overlapped path) is the forward mode of the solved terms")


@dataclass(frozen=True)
class MergeConfig:
    """The affine merge (`AffineMerge` / `AffineMergeTcSm90`): each segment's start state and the final state.
    impl: `staged` (M through shared memory, 32 columns per CTA), `prefetch` (as staged, next M in registers,
    8 columns), `regs` (K = 128: M's blocks in registers, warp-shuffle sums), `tc` (SM90, K = 128: the chain on
    tensor cores, bf16 hi / lo splits). starts_only: each sequence's last summary is never read and no final
    state is written. pdl: launched early after the summary launch, waits inside."""

    impl: str
    k_dim: int = 128
    v_dim: int = 128
    initial_state: bool = False
    starts_only: bool = False
    pdl: bool = False

    def __post_init__(self):
        if self.impl not in MERGE_IMPLS:
            raise ValueError(f"impl must be one of {MERGE_IMPLS}, got {self.impl!r}")
        if not merge_fits(self.impl, self.k_dim, self.v_dim):
            threads, block_v = MERGE_SHAPES[self.impl]
            raise ValueError(f"affine merge {self.impl!r} does not handle K={self.k_dim}, V={self.v_dim} (needs "
                             + ("K = 128, " if self.impl in ("regs", "tc") else f"K % 4 == 0, K * K / 4 a multiple "
                                f"of {threads}, ") + f"V a multiple of {block_v})")


def merge_fits(impl: str, k_dim: int, v_dim: int) -> bool:
    """Whether affine-merge `impl` handles K = k_dim, V = v_dim (whole 16-byte M pieces per thread, whole V
    tiles; regs and tc are built for K = 128)."""
    threads, block_v = MERGE_SHAPES[impl]
    if impl in ("tc", "regs"):
        return k_dim == 128 and v_dim % block_v == 0
    return (k_dim % 4 == 0 and v_dim % block_v == 0 and (k_dim * block_v) % threads == 0
            and threads % block_v == 0 and (k_dim * k_dim // 4) % threads == 0)


DECODE_HEAD_DIMS = (128,)
DECODE_ROWS = 64   # query rows of one work tile (one wgmma M): group x q_len must fit
DECODE_MERGE_BATCHES = (1, 2, 4, 8, 16)   # splits the fixup reads at once (16 x 8 fp32 registers: no spills)


@dataclass(frozen=True)
class DecodeConfig:
    """Split-KV decode attention (`SplitKVDecodeSm90`): one split of one (batch row, KV head) unit per work tile.

    group: query heads per KV head (GQA); q_len: new tokens per row, causal among themselves; group x q_len query
    rows share the unit's K / V reads. paged: the cache is [pages, page_size, Hkv, D] read through a page table
    (else [B, Tmax, Hkv, D]). softcap: scores pass through c tanh(s / c). persistent: the stream-K table (CTAs
    loop over their pieces); else an even split, each CTA's tile computed from its index. stages: the K / V ring's
    depth (32 KB a stage at D = 128). merge_batch: the fixup's splits read at once (`decode_fixup.merge_unit`), the
    planner's power of two covering the split count, at most 16. longest_first (an even split only): the tiles go
    out longest batch row first, ranked on the device from the true lengths, so in a grid of several waves a long
    row of a ragged batch starts early instead of finishing alone."""

    head_dim: int = 128
    group: int = 1
    q_len: int = 1
    paged: bool = False
    softcap: bool = False
    persistent: bool = False
    stages: int = 2
    merge_batch: int = 4
    longest_first: bool = False

    def __post_init__(self):
        if self.longest_first and self.persistent:
            raise ValueError("longest_first orders an even split's tiles; a persistent (stream-K) plan has a table")
        if self.head_dim not in DECODE_HEAD_DIMS:
            raise ValueError(f"head_dim must be one of {DECODE_HEAD_DIMS}, got {self.head_dim}")
        if not 1 <= self.q_len <= 8:
            raise ValueError(f"q_len must be in [1, 8], got {self.q_len}")
        if self.group < 1 or self.group * self.q_len > DECODE_ROWS:
            raise ValueError(f"group x q_len must be in [1, {DECODE_ROWS}], got {self.group} x {self.q_len}")
        if not 2 <= self.stages <= 4:
            raise ValueError(f"stages must be in [2, 4], got {self.stages}")
        if self.merge_batch not in DECODE_MERGE_BATCHES:
            raise ValueError(f"merge_batch must be one of {DECODE_MERGE_BATCHES}, got {self.merge_batch}")


STATE_SOURCES = ("none", "dense", "pool")


STEP_GROUP = 8   # the decode step's tokens staged at once (the most a compile-time token count may be)


@dataclass(frozen=True)
class RecurrentConfig:
    """The recurrent step (`RecurrentStep`, every arch): token by token over a state held in registers, for
    decoding (a few tokens per sequence).

    kda: per-key decay g [.., HV, K] (else one per head). group: value heads per q/k head (GVA, HV = group x H).
    varlen: sequences packed along T, bounds from cu_seqlens on the device. initial / final: where the state
    comes from and goes to: "none" (zero / not written), "dense" ([N, HV, K, V], row n) or "pool" ([P, HV, K, V],
    row from an index array; -1 = zero state / no write). spec (speculative decoding): the state is read at
    index [n, num_accepted_tokens[n] - 1] and the state after each token t written at index [n, t].
    l2norm: q and k normalized in the kernel. gate_in_kernel: g is the raw gate: g = -exp(A_log) softplus(g +
    dt_bias), or with lower_bound (KDA) g = lower_bound sigmoid(exp(A_log) (g + dt_bias)) (a_log False: A = 1).
    beta_sigmoid: beta is a logit (neg_eigval: 2 sigmoid(beta)). tokens: the tokens per sequence as a compile-time
    count (1..STEP_GROUP, not varlen; the token loop unrolled), or 0: read from T. tensor_cores: the tokens as one
    block in the chunk form on warp-level tf32 tensor cores (`TensorCoreStep`: GDN, a compile-time count, no spec)."""

    kda: bool = False
    head_dim: int = 128
    group: int = 1
    varlen: bool = False
    initial: str = "none"
    final: str = "none"
    spec: bool = False
    l2norm: bool = False
    gate_in_kernel: bool = False
    a_log: bool = False
    dt_bias: bool = False
    lower_bound: bool = False
    beta_sigmoid: bool = False
    neg_eigval: bool = False
    tokens: int = 0
    tensor_cores: bool = False

    def __post_init__(self):
        if not 0 <= self.tokens <= STEP_GROUP or (self.tokens and self.varlen):
            raise ValueError(f"tokens must be 0, or 1..{STEP_GROUP} without varlen, got {self.tokens}")
        if self.head_dim != 128:
            raise ValueError(f"head_dim must be 128, got {self.head_dim}")
        if self.group < 1:
            raise ValueError(f"group must be >= 1, got {self.group}")
        for name in ("initial", "final"):
            if getattr(self, name) not in STATE_SOURCES:
                raise ValueError(f"{name} must be one of {STATE_SOURCES}, got {getattr(self, name)!r}")
        if self.spec and (self.initial != "pool" or self.final != "pool"):
            raise ValueError("spec needs initial and final both 'pool'")
        if (self.a_log or self.dt_bias or self.lower_bound) and not self.gate_in_kernel:
            raise ValueError("a_log, dt_bias and lower_bound need gate_in_kernel")
        if self.lower_bound and not self.kda:
            raise ValueError("lower_bound is KDA's")
        if self.gate_in_kernel and not (self.a_log or self.lower_bound):
            raise ValueError("gate_in_kernel needs a_log (or, KDA, lower_bound)")
        if self.neg_eigval and not self.beta_sigmoid:
            raise ValueError("neg_eigval needs beta_sigmoid")
        if self.tensor_cores and (self.kda or self.spec or not self.tokens):
            raise ValueError("tensor_cores is GDN's, with a compile-time token count and no spec")
