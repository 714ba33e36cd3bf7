"""FLA-compatible ops: `chunk_gated_delta_rule` (GDN, scalar decay) and `chunk_kda` (per-channel decay).

Layouts follow flash-linear-attention 0.6: q, k `[B, T, H, K]`, v `[B, T, H, V]`, beta `[B, T, H]`, g `[B, T, H]`
(GDN) or `[B, T, H, K]` (KDA) per-step natural-log decay, states `[N, H, K, V]` fp32 where N = B, or
N = len(cu_seqlens) - 1 with B == 1 (varlen). Returns (o `[B, T, H, V]` in q's dtype, final_state or None).
"""

from __future__ import annotations

import os

import torch

from ..checks import check_cuda, check_no_grad, check_qkv, check_shape, check_tensor
from ..kernels.build import build_qk_l2norm
from ..kernels.configs import GateForm
from ..paths import plain_gate
from ..paths.fused import DeviceTableRun, FusedRun
from ..paths.two_phase import OverlapRun, PrepRun, StateRun, overlap_free, prep_config
from ..plan import ForwardPlan, PlanOptions, plan_forward
from ..runtime.arch import device_kind, sm_count
from . import last
from .state_pool import check_pool, gather_states, scatter_states

IO_DTYPES = (torch.bfloat16, torch.float16)
SUPPORTED_HEAD_DIMS = (128,)


def validate_inputs(q, k, v, g, beta, initial_state, cu_seqlens, kda: bool, scale, read_cu: bool = True):
    """Check everything on the host; returns (B, T, HV, K, V, N, cu, group) with HV the value heads (GVA: v, g,
    beta and the states have HV = group x H heads, q and k H), cu the cu_seqlens values as a tuple (or None).
    Every error names the argument."""
    B, T, H, K, HV, V = check_qkv(q, k, v, IO_DTYPES, SUPPORTED_HEAD_DIMS)
    check_tensor("g", g, dtypes=(torch.float32, q.dtype), ndim=4 if kda else 3)
    check_shape("g", g, (B, T, HV, K) if kda else (B, T, HV))
    check_tensor("beta", beta, dtypes=(torch.float32, q.dtype), ndim=3, align=4)
    check_shape("beta", beta, (B, T, HV))
    if scale is not None and not (isinstance(scale, (int, float)) and scale > 0):
        raise ValueError(f"scale must be a positive number or None, got {scale!r}")
    N, cu = B, None
    if cu_seqlens is not None:
        if not isinstance(cu_seqlens, torch.Tensor):
            raise TypeError(f"cu_seqlens must be a torch.Tensor, got {type(cu_seqlens).__name__}")
        if cu_seqlens.dtype not in (torch.int32, torch.int64) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
            raise TypeError(f"cu_seqlens must be a 1-D int32/int64 tensor with >= 2 entries, got "
                            f"{cu_seqlens.dtype} {tuple(cu_seqlens.shape)}")
        if B != 1:
            raise ValueError(f"cu_seqlens needs B == 1 (packed sequences), got B={B}")
        N = cu_seqlens.numel() - 1
        if read_cu:
            vals = cu_seqlens.tolist()  # one host read: the schedule is built from the lengths anyway
            if vals[0] != 0 or any(b < a for a, b in zip(vals, vals[1:])) or vals[-1] != T:
                raise ValueError(f"cu_seqlens must start at 0, be non-decreasing and end at T={T}, got "
                                 f"{vals[:6]}{'...' if len(vals) > 6 else ''}")
            cu = tuple(vals)
        elif not cu_seqlens.is_cuda:   # graph mode: the offsets stay on the device, where the kernels read them
            raise ValueError("use_graph=True needs cu_seqlens on the GPU (it is never read on the host)")
    if initial_state is not None:
        check_tensor("initial_state", initial_state, dtypes=(torch.float32,), ndim=4)
        check_shape("initial_state", initial_state, (N, HV, K, V))
    check_cuda(q=q, k=k, v=v, g=g, beta=beta, initial_state=initial_state,
               cu_seqlens=cu_seqlens if cu_seqlens is not None and cu_seqlens.is_cuda else None)
    return B, T, HV, K, V, N, cu, HV // H


# CUTE_KERNELS_CHECK_GATES=1: assert g <= 0 on the device (asynchronously) in every call: a pass over g, so off.
CHECK_GATES = os.environ.get("CUTE_KERNELS_CHECK_GATES", "0") == "1"


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
                           state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None, chunk_indices=None,
                           cp_context=None, *, use_gate_in_kernel=False, A_log=None, dt_bias=None, scheduler=None,
                           out=None, initial_state_indices=None, final_state_indices=None, use_graph=False,
                           max_num_seqs=None):
    """Gated delta rule forward (GDN: one log-decay per value head and token), FLA 0.6's signature and semantics.

    FLA's gate arguments: `use_gate_in_kernel` (g raw: g = -exp(A_log) softplus(g + dt_bias), A_log and dt_bias
    [HV]), `use_beta_sigmoid_in_kernel` (beta a logit), `allow_neg_eigval` (2 sigmoid(beta)). `cu_seqlens_cpu`
    (the same offsets on the host) saves the one host read of cu_seqlens. `chunk_indices` is accepted and unused;
    `state_v_first` and `cp_context` raise (see `cute_kernels.distributed` for context parallel).
    State pool (`ops/state_pool.py`): with `initial_state_indices` / `final_state_indices` (int32 [N]),
    `initial_state` is a pool [P, HV, K, V] read and written in place through them (-1: zero state / no write).
    `use_graph=True` (cu_seqlens on the GPU, padded with zero-length sequences to `max_num_seqs` + 1 entries):
    cu_seqlens is never read on the host, so a captured call replays with new lengths (the fused kernel, one CTA
    per (sequence, head), no segments).
    `scheduler` (from `schedulers`) pins the fused kernel's work decomposition (default: the planner's path and
    split, `last_plan()` says which; eager calls only). `out=(o, final_state)` writes into given tensors
    (final_state may be None). Forward-only: an input that requires grad under grad mode raises. Under
    torch.compile the call is the custom op `torch.ops.cute_kernels.chunk_gated_delta_rule`. SM90 only for now.
    """
    unsupported_arguments("chunk_gated_delta_rule", state_v_first=state_v_first, cp_context=cp_context)
    gate = gate_arguments(g, beta, False, use_gate_in_kernel, A_log, dt_bias, None, use_beta_sigmoid_in_kernel,
                          allow_neg_eigval)
    return pooled_forward(q, k, v, g, beta, scale, initial_state, output_final_state,
                          cu_seqlens_cpu if cu_seqlens_cpu is not None and not use_graph else cu_seqlens, use_qk_l2norm_in_kernel,
                          scheduler, out, initial_state_indices, final_state_indices, kda=False,
                          use_graph=use_graph, max_num_seqs=max_num_seqs, gate=gate)


def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False,
              allow_neg_eigval=False, safe_gate=False, lower_bound=None, disable_recompute=False,
              return_intermediate_states=False, state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None,
              cp_context=None, use_graph=False, max_num_seqs=None, *, A_log=None, dt_bias=None, scheduler=None,
              out=None, initial_state_indices=None, final_state_indices=None):
    """Kimi Delta Attention forward (one log-decay per key channel, g [B, T, HV, K]), FLA 0.6's signature.

    Any g <= 0 is accepted: the intra-chunk products never exponentiate a positive number (see
    cute_kernels/reference/kda_intra.py), so `safe_gate` changes nothing here. g > 0 (growth, not decay) is outside
    the contract of both ops; it is not checked by default because the check is a pass over g: set
    CUTE_KERNELS_CHECK_GATES=1 to assert g <= 0 on the device (asynchronously, no host sync).
    Gate arguments as FLA: `use_gate_in_kernel` (g = -exp(A_log) softplus(g + dt_bias), or with `lower_bound`
    g = lower_bound sigmoid(exp(A_log) (g + dt_bias)); dt_bias [HV, K] or [HV * K]), `use_beta_sigmoid_in_kernel`,
    `allow_neg_eigval`. `disable_recompute` (a training option) changes nothing; `use_graph` / `max_num_seqs` as
    `chunk_gated_delta_rule`; `return_intermediate_states`, `state_v_first` and `cp_context` raise. Other extra arguments as `chunk_gated_delta_rule`.
    SM90 only for now.
    """
    unsupported_arguments("chunk_kda", state_v_first=state_v_first, cp_context=cp_context,
                          return_intermediate_states=return_intermediate_states)
    gate = gate_arguments(g, beta, True, use_gate_in_kernel, A_log, dt_bias, lower_bound, use_beta_sigmoid_in_kernel,
                          allow_neg_eigval)
    return pooled_forward(q, k, v, g, beta, scale, initial_state, output_final_state,
                          cu_seqlens_cpu if cu_seqlens_cpu is not None and not use_graph else cu_seqlens, use_qk_l2norm_in_kernel,
                          scheduler, out, initial_state_indices, final_state_indices, kda=True,
                          use_graph=use_graph, max_num_seqs=max_num_seqs, gate=gate)


def pooled_forward(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, use_qk_l2norm_in_kernel,
                   scheduler, out, initial_state_indices, final_state_indices, *, kda: bool, use_graph: bool = False,
                   max_num_seqs: int | None = None, gate=None):
    """`forward`, with the states through a pool when indices are given: the start states gathered from the
    pool, the final states scattered back into it (returned: the pool itself)."""
    if initial_state_indices is None and final_state_indices is None:
        return forward(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                       use_qk_l2norm_in_kernel, scheduler, out, kda=kda, use_graph=use_graph,
                       max_num_seqs=max_num_seqs, gate=gate)
    check_tensor("q", q, dtypes=IO_DTYPES, ndim=4)
    check_tensor("v", v, dtypes=(q.dtype,), ndim=4)
    N = q.shape[0] if cu_seqlens is None else len(cu_seqlens) - 1
    HV = v.shape[2]
    check_pool(initial_state, N, HV, initial_state_indices, final_state_indices)
    if out is not None and out[1] is not None:
        raise ValueError("out[final_state] must be None with a state pool: the final states go to the pool")
    if out is not None and final_state_indices is not None:   # the final states' scratch, before the scatter
        out = (out[0], torch.empty((N, HV, 128, 128), dtype=torch.float32, device=initial_state.device))
    start = gather_states(initial_state, initial_state_indices) if initial_state_indices is not None else None
    o, final = forward(q, k, v, g, beta, scale, start, final_state_indices is not None, cu_seqlens,
                       use_qk_l2norm_in_kernel, scheduler, out, kda=kda, use_graph=use_graph,
                       max_num_seqs=max_num_seqs, gate=gate)
    if final_state_indices is not None:
        scatter_states(final, initial_state, final_state_indices)
    return o, initial_state if output_final_state else None


def unsupported_arguments(name: str, **flags) -> None:
    """FLA arguments these ops do not implement: set, each raises, naming it."""
    why = {"state_v_first": "states are [.., K, V]",
           "cp_context": "FLA's context parallel; cute_kernels.distributed splits a sequence over ranks",
           "return_intermediate_states": "per-chunk states are not kept"}
    for arg, value in flags.items():
        if value is not None and value is not False:
            raise NotImplementedError(f"{name}: {arg} is not supported ({why[arg]})")


def gate_arguments(g, beta, kda: bool, use_gate_in_kernel: bool, A_log, dt_bias, lower_bound,
                   use_beta_sigmoid_in_kernel: bool, allow_neg_eigval: bool):
    """FLA's gate arguments, checked, as the kernels apply them while loading g and beta: (GateForm, A_log fp32
    [HV] or None, dt_bias fp32 flat or None, lower_bound or None). Without them, the plain form."""
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError("allow_neg_eigval=True requires use_beta_sigmoid_in_kernel=True (as FLA)")
    a_log = bias = None
    if use_gate_in_kernel:
        check_tensor("g", g, dtypes=(torch.float32, torch.bfloat16, torch.float16), ndim=4 if kda else 3)
        HV = g.shape[2]
        if A_log is None and lower_bound is None:
            raise ValueError("A_log must be given when use_gate_in_kernel=True" + (" (or lower_bound)" if kda else ""))
        if lower_bound is not None and (isinstance(lower_bound, bool) or not isinstance(lower_bound, (int, float))
                                        or lower_bound >= 0):
            raise ValueError(f"lower_bound must be a negative number, got {lower_bound!r}")
        if dt_bias is not None:
            check_tensor("dt_bias", dt_bias, dtypes=(torch.float32, torch.bfloat16, torch.float16), align=4)
            want = HV * g.shape[3] if kda else HV
            if dt_bias.numel() != want:
                raise ValueError(f"dt_bias must have {want} elements ([HV{', K' if kda else ''}]), got shape "
                                 f"{tuple(dt_bias.shape)}")
            bias = dt_bias.reshape(-1).float()
        if A_log is not None:
            check_tensor("A_log", A_log, dtypes=(torch.float32, torch.bfloat16, torch.float16), align=4)
            if A_log.numel() != HV:
                raise ValueError(f"A_log must have HV = {HV} elements, got shape {tuple(A_log.shape)}")
            a_log = A_log.reshape(-1).float()
    else:
        lower_bound = None
    if use_beta_sigmoid_in_kernel:
        check_tensor("beta", beta, dtypes=(torch.float32, torch.bfloat16, torch.float16), ndim=3, align=4)
    form = GateForm(g=("bounded" if lower_bound is not None else "softplus") if use_gate_in_kernel else "log",
                    a_log=a_log is not None, dt_bias=bias is not None,
                    beta=("sigmoid2" if allow_neg_eigval else "sigmoid") if use_beta_sigmoid_in_kernel else "value")
    return form, a_log, bias, (float(lower_bound) if lower_bound is not None else None)


def gate_inputs(g, beta, kda: bool, use_gate_in_kernel: bool, A_log, dt_bias, lower_bound,
                use_beta_sigmoid_in_kernel: bool, allow_neg_eigval: bool):
    """FLA's gate arguments applied to (g, beta) before the kernels, one elementwise pass each (the custom op's
    path under torch.compile; eager calls apply them in the kernels' loads, `gate_arguments`). g comes back fp32
    when transformed. Without them, (g, beta) unchanged."""
    form, a_log, bias, lower_bound = gate_arguments(g, beta, kda, use_gate_in_kernel, A_log, dt_bias, lower_bound,
                                                    use_beta_sigmoid_in_kernel, allow_neg_eigval)
    if form.g != "log":
        HV = g.shape[2]
        x = g.float()
        if bias is not None:
            x = x + bias.reshape((HV, -1) if kda else (HV,))
        a = a_log.exp().reshape((HV, 1) if kda else (HV,)) if a_log is not None else None
        if form.g == "bounded":
            g = lower_bound * torch.sigmoid(x if a is None else a * x)
        else:
            g = -a * torch.nn.functional.softplus(x)
    if form.beta != "value":
        beta = torch.sigmoid(beta.float()) * (2.0 if form.beta == "sigmoid2" else 1.0)
    return g, beta


_last: tuple | None = None   # (plan, path, capturing) of the last call


def explain_last() -> str | None:
    """How the last chunk_gated_delta_rule / chunk_kda call split its work, and why."""
    if _last is None:
        return None
    plan, path, capturing = _last
    text = plan.explain(capturing)
    if path != plan.path(capturing):
        text += f"\n- ran the {path} path instead: an overlapped call on another stream may still be running"
    return text


def forward(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, use_qk_l2norm_in_kernel,
            scheduler, out, *, kda: bool, options: PlanOptions | None = None, use_graph: bool = False,
            max_num_seqs: int | None = None, gate=None):
    """The ops' common forward: validate, plan (cached), run. `options` pins the planner's choices (tests).
    `use_graph` with cu_seqlens: cu_seqlens is never read on the host (`DeviceTableRun`). `gate`: FLA's gate
    arguments (`gate_arguments`), applied by the kernels as they load g and beta (None: g and beta as given)."""
    global _last
    name = "chunk_kda" if kda else "chunk_gated_delta_rule"
    check_no_grad(name, q=q, k=k, v=v, g=g, beta=beta, initial_state=initial_state)
    graph_varlen = use_graph and cu_seqlens is not None
    B, T, H, K, V, N, cu, group = validate_inputs(q, k, v, g, beta, initial_state, cu_seqlens, kda=kda,
                                                  scale=scale, read_cu=not graph_varlen)   # H: value heads
    if graph_varlen and max_num_seqs is not None and N != max_num_seqs:
        raise ValueError(f"use_graph=True: cu_seqlens must have max_num_seqs + 1 = {max_num_seqs + 1} entries (pad "
                         f"with zero-length sequences), got {N + 1}")
    if graph_varlen and scheduler is not None:
        raise ValueError("use_graph=True plans on the device: scheduler= cannot pin a split there")
    device = q.device
    if use_qk_l2norm_in_kernel:
        q, k = normalized_qk(q, k)
    scale = float(scale) if scale is not None else K ** -0.5
    init = initial_state is not None
    if out is not None:
        o, final = out
        check_tensor("out[o]", o, dtypes=(q.dtype,), ndim=4)
        check_shape("out[o]", o, (B, T, H, V))
        if final is not None:
            check_tensor("out[final_state]", final, dtypes=(torch.float32,), ndim=4)
            check_shape("out[final_state]", final, (N, H, K, V))
    else:
        o = torch.empty_like(v)
        final = torch.empty((N, H, K, V), dtype=torch.float32, device=device) if output_final_state else None
    if T == 0 or N == 0:
        if final is not None:
            final.copy_(initial_state if init else torch.zeros_like(final))
        return o, final if output_final_state else None
    form, a_log, bias, lower_bound = gate if gate is not None else (GateForm(), None, None, None)
    if CHECK_GATES and form.g == "log":
        torch._assert_async((g <= 0).all(), "g must be <= 0 (a log decay)")
    g32 = g if g.dtype == torch.float32 else g.float()
    stand_in, _, _ = plain_gate(device)
    gate_args = (a_log if a_log is not None else stand_in, bias if bias is not None else stand_in,
                 lower_bound if lower_bound is not None else 0.0)
    if graph_varlen:
        key = ("device_table", kda, H, q.dtype, beta.dtype, init, final is not None, device, group, form)
        runner = _runs.get(key)
        if runner is None:
            runner = _runs[key] = DeviceTableRun(kda, H, q.dtype, beta.dtype, init, final is not None, device, group,
                                                 form)
        last.record(lambda: "use_graph varlen: the fused kernel, one CTA per (sequence, head), its tile table built "
                            "on the device from cu_seqlens (no host read)")
        runner.run(q, k, v, g32, beta, scale, initial_state, o, final, gate_args, cu_seqlens)
        return o, final if output_final_state else None
    plan = plan_forward(kda, B, T, H, cu, init, sm_count(device), device_kind(device), scheduler, options)
    capturing = is_capturing(device)
    path = plan.path(capturing)
    if path == "overlap" and not overlap_free(device):
        path = "two_phase"
    _last = (plan, path, capturing)
    last.record(explain_last)
    key = (q.dtype, beta.dtype, init, final is not None, device, group, form)
    run(plan, path, key).run(q, k, v, g32, beta, scale, initial_state, o, final, gate_args)
    if not capturing and plan.graph_path != path:
        # a capture of this call would take another path: build its runner now (a capture cannot copy tables)
        run(plan, plan.graph_path, key)
    return o, final if output_final_state else None


def normalized_qk(q, k):
    """use_qk_l2norm_in_kernel: q and k divided by their rows' norms (FLA's l2norm, eps 1e-6), one launch for both
    (`QKL2Norm`: each row read and written once)."""
    if q.numel() == 0:
        return q, k
    qn, kn = torch.empty_like(q), torch.empty_like(k)
    build_qk_l2norm(q.dtype).fn(q, k, qn, kn)
    return qn, kn


def is_capturing(device) -> bool:
    """Whether this call is being captured into a CUDA graph (its host time then does not recur)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


class TwoPhaseRun:
    """The plain two-phase path: phase 1 into its terms (a kept workspace for small calls), then the state pass."""

    def __init__(self, prep: PrepRun, state: StateRun):
        self.prep, self.state = prep, state

    def run(self, q, k, v, g32, beta, scale, initial_state, o, final, gate):
        terms = self.prep.run(q, k, v, g32, beta, scale, gate, reuse=True)
        self.state.run(terms, initial_state, o, final)


_runs: dict = {}


def run(plan: ForwardPlan, path: str, key: tuple):
    """The runner of `plan`'s `path` for these dtypes and state arguments (built once, cached)."""
    full = (plan, path) + key
    hit = _runs.get(full)
    if hit is not None:
        return hit
    io, beta_dtype, init, final, device, group, gate = key
    B, T, H = plan.shape
    if path == "fused":
        hit = FusedRun(plan.kda, H, plan.fused_schedule, plan.fused_summary, plan.merge_impl, io, beta_dtype, init,
                       final, device, group, gate)
    elif path == "overlap":
        hit = OverlapRun(B, T, H, plan.kda, io, beta_dtype, init, final, device, sm_count(device), group, gate)
    else:
        prep = PrepRun(prep_config(plan.kda, plan.prep_ctas_per_sm, group, gate), B, T, H, plan.cu, io, beta_dtype,
                       device, plan.prep_tile_counts)
        hit = TwoPhaseRun(prep, StateRun(plan.kda, not plan.kda, B, T, H, plan.cu, io, init, final, plan.segments,
                                         plan.merge_impl, device, group=group if not plan.kda else 1))
    if len(_runs) > 256:
        _runs.clear()
    _runs[full] = hit
    return hit
