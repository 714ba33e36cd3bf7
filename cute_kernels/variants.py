"""Every compiled variant the ops run, for `python -m cute_kernels compile` and the compile tests. A variant is (op,
name, build, PTX patterns that must appear): one config of a kernel with its dtypes. No GPU needed; `CUTE_DSL_ARCH`
must be set before the first `import cutlass`. SM90 (wgmma) kernels build for sm_90a only, SM100 (tcgen05) ones for
sm_100a and sm_103a (the fused GDN and KDA forward, the decode, the tensor-core merge); the SIMT kernels for all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

SM90 = ("sm_90a",)
SM100 = ("sm_100a", "sm_103a")
ANY = SM90 + SM100
WGMMA, TMA_LOAD, REGS_UP = "wgmma.mma_async", "cp.async.bulk.tensor", "setmaxnreg.inc"
TCGEN05 = ("tcgen05.mma", "tcgen05.alloc", "tcgen05.ld", "tcgen05.commit", "tcgen05.dealloc")
PUBLISH = ("fence.acq_rel.gpu", "atom.global.release.add")   # phase 1 publishing a chunk: release fence, add
# 16-byte accesses: v4.b32 on sm_90a, v2.b64 on sm_100a ("a|b": either one)
LD_GLOBAL_16B, LD_SHARED_16B, ST_SHARED_16B = (f"{op}.v4|{op}.v2.b64" for op in ("ld.global", "ld.shared", "st.shared"))


@dataclass(frozen=True)
class Variant:
    op: str
    name: str
    compile: Callable  # (dump_dir) -> runtime.compile.Compiled
    ptx_must_have: tuple[str, ...] = ()       # substrings ("a|b": either), any arch
    archs: tuple[str, ...] = ANY

    def required(self, arch: str) -> tuple[str, ...]:
        return (f".target {arch}",) + self.ptx_must_have

    def missing(self, arch: str, ptx: str) -> list[str]:
        """The required patterns `ptx` lacks."""
        return [p for p in self.required(arch) if not any(alt in ptx for alt in p.split("|"))]


def all_variants(arch: str | None = None) -> list[Variant]:
    """Every variant, or those built for `arch`."""
    return [v for v in _variants() if arch is None or arch in v.archs]


def _dtype_tag(t) -> str:
    return str(t).replace("torch.", "")


def _variants() -> list[Variant]:
    import torch

    from .kernels.build import (build_affine_merge, build_decode, build_decode_fixup, build_fused, build_lse_merge,
                                build_prep, build_recurrent_step, build_state_pass,
                                build_qk_l2norm, build_state_pool_copy)
    from .kernels.configs import (DecodeConfig, FusedConfig, GateForm, MergeConfig, PrepConfig, RecurrentConfig,
                                  StateConfig)

    bf, f16, f32 = torch.bfloat16, torch.float16, torch.float32
    out = []
    # the affine merge: every impl `merge_impl_for` picks, as the public op and the segmented paths run them
    for impl, k, v, init, starts, pdl in [
            ("staged", 128, 128, True, False, False), ("staged", 64, 64, False, False, False),
            ("staged", 128, 128, False, True, True),
            ("prefetch", 128, 128, True, False, False), ("prefetch", 64, 64, False, False, False),
            ("prefetch", 128, 128, False, True, True),
            ("regs", 128, 128, True, False, False), ("regs", 128, 128, False, True, False),
            ("regs", 128, 128, True, True, True), ("regs", 128, 128, False, True, True),
            ("tc", 128, 128, True, False, False), ("tc", 128, 128, False, True, False),
            ("tc", 128, 128, True, True, True), ("tc", 128, 128, False, True, True)]:
        cfg = MergeConfig(impl, k, v, init, starts, pdl)
        name = (f"affine_merge_{impl}_k{k}_v{v}" + ("_init" if init else "") + ("_starts" if starts else "")
                + ("_pdl" if pdl else ""))
        need = ("fma.rn.f32", "bar.sync") if impl != "tc" else (WGMMA + ".sync.aligned.m64n128k16",
                                                                "mbarrier.try_wait")
        need += {"staged": (LD_SHARED_16B,), "prefetch": (LD_SHARED_16B, LD_GLOBAL_16B),
                 "regs": ("shfl.sync.bfly", ST_SHARED_16B), "tc": ()}[impl]
        need += ("griddepcontrol.wait", "griddepcontrol.launch_dependents") if pdl else ()
        out.append(Variant("affine_merge", name, lambda d, cfg=cfg: build_affine_merge(cfg, dump_dir=d), need,
                           SM90 if impl == "tc" else ANY))
        if impl == "tc":   # the SM100 build of the same config: tcgen05 MMAs into TMEM
            out.append(Variant("affine_merge", name, lambda d, cfg=cfg: build_affine_merge(cfg, dump_dir=d),
                               TCGEN05 + (("griddepcontrol.wait",) if pdl else ()), SM100))
    for dim, dt in [(128, bf), (128, f16), (128, f32), (64, bf)]:
        out.append(Variant("lse_merge", f"lse_merge_d{dim}_{_dtype_tag(dt)}",
                           lambda d, dim=dim, dt=dt: build_lse_merge(dim, dt, dump_dir=d),
                           (LD_GLOBAL_16B, "ex2.approx")))
    for kda in (False, True):
        op, tag = ("chunk_kda", "kda") if kda else ("chunk_gated_delta_rule", "gdn")
        # fused: forward (initial / final state or not; fp16 with fp32 beta), persistent, summary and output launches
        fused = [(FusedConfig(kda, "forward", True, True), bf, bf), (FusedConfig(kda, "forward"), bf, bf),
                 (FusedConfig(kda, "forward", True, True), f16, f32),
                 (FusedConfig(kda, "forward", True, True, persistent=True), bf, bf),
                 (FusedConfig(kda, "summary"), bf, bf), (FusedConfig(kda, "segment_outputs", True, True), bf, bf)]
        fused.append((FusedConfig(kda, "forward", True, True, group=2), bf, bf))   # GVA
        # FLA's gate arguments in the loads: GDN's softplus gate, KDA's bounded one; beta through a sigmoid
        in_kernel = GateForm("bounded" if kda else "softplus", True, True, "sigmoid2")
        fused.append((FusedConfig(kda, "forward", True, True, gate=in_kernel), bf, bf))
        for cfg, io, beta in fused:
            name = (f"{tag}_fused_{cfg.mode}" + ("_init" if cfg.initial_state else "")
                    + ("_final" if cfg.final_state else "") + ("_persistent" if cfg.persistent else "")
                    + (f"_gva{cfg.group}" if cfg.group > 1 else "") + (f"_gate_{cfg.gate.g}" if cfg.gate.g != "log"
                                                                        else "")
                    + f"_{_dtype_tag(io)}_beta_{_dtype_tag(beta)}")
            need = (WGMMA, TMA_LOAD, REGS_UP, "setmaxnreg.dec")
            need += ("ex2.approx",) if cfg.gate.g != "log" else ()
            need += ("st.shared.v4", "ld.shared.v4", "cp.async.ca.shared.global", "cp.async.wait_group") if kda else ()
            out.append(Variant(op, name, lambda d, c=cfg, io=io, b=beta: build_fused(c, io, b, dump_dir=d), need, SM90))
            # the SM100 build of the same config: tcgen05 MMAs into TMEM, the solve on tf32 mma.sync (KDA: the
            # 16-column band reads)
            need = TCGEN05 + ("tcgen05.st", TMA_LOAD, "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32",
                              ST_SHARED_16B) + (("ex2.approx",) if cfg.gate.g != "log" else ())
            need += ("tcgen05.ld.sync.aligned.32x32b.x16",) if kda else ()
            out.append(Variant(op, name, lambda d, c=cfg, io=io, b=beta: build_fused(c, io, b, dump_dir=d), need,
                               SM100))
        # phase 1: the plain path's folded builds (GDN at 2 and 3 CTAs per SM), the overlapped path's builds
        preps = ([(PrepConfig(kda=True, terms="folded", ctas_per_sm=1), ("cp.async.bulk.tensor.3d.global.shared",)),
                  (PrepConfig(kda=True, terms="folded", ctas_per_sm=1, publish=True), PUBLISH)]
                 if kda else
                 [(PrepConfig(terms="folded", ctas_per_sm=2), (".minnctapersm 2",)),
                  (PrepConfig(terms="folded", ctas_per_sm=3), (".minnctapersm 3",)),
                  (PrepConfig(terms="solved", ctas_per_sm=1, publish=True), PUBLISH + (REGS_UP,))])
        for cfg, extra in preps:
            name = f"{tag}_prep_{cfg.terms}_{cfg.ctas_per_sm}_per_sm" + ("_publish" if cfg.publish else "")
            need = (WGMMA, TMA_LOAD, "st.global.v4", "griddepcontrol.launch_dependents") + extra
            out.append(Variant(op, name, lambda d, c=cfg: build_prep(c, bf, bf, dump_dir=d), need, SM90))
        out.append(Variant(op, f"{tag}_prep_folded_gva2",
                           lambda d, kda=kda: build_prep(PrepConfig(kda, "folded", 1 if kda else 2, group=2), bf, bf,
                                                         dump_dir=d), (WGMMA, TMA_LOAD), SM90))
        out.append(Variant(op, f"{tag}_prep_folded_gate_{in_kernel.g}",
                           lambda d, kda=kda, gate=in_kernel: build_prep(PrepConfig(kda, "folded", 1 if kda else 2,
                                                                                    gate=gate), bf, bf, dump_dir=d),
                           (WGMMA, TMA_LOAD, "ex2.approx"), SM90))
        out.append(Variant(op, f"{tag}_prep_folded_fp16_beta_float32",
                           lambda d, kda=kda: build_prep(PrepConfig(kda, "folded", 1 if kda else 2), f16, f32,
                                                         dump_dir=d), (WGMMA, TMA_LOAD), SM90))
        # phase 2: the plain path's modes, the overlapped path's consumer
        states = [StateConfig(kda, "forward", True, True, not kda), StateConfig(kda, "forward", False, False, not kda),
                  StateConfig(kda, "summary", token_factors=not kda),
                  StateConfig(kda, "segment_outputs", True, True, not kda),
                  StateConfig(kda, "segment_outputs", True, False, not kda),
                  StateConfig(kda, "forward", True, True, consume=True),
                  StateConfig(kda, "forward", False, False, consume=True)]
        for cfg in states:
            name = (f"{tag}_state_{cfg.mode}" + ("_init" if cfg.initial_state else "")
                    + ("_final" if cfg.final_state else "") + ("_consume" if cfg.consume else ""))
            need = (WGMMA + ".sync.aligned.m64n128k16", TMA_LOAD, REGS_UP, "griddepcontrol.wait")
            need += ("ld.acquire.gpu.global", "vote.sync.ballot") if cfg.consume else ()
            out.append(Variant(op, name, lambda d, c=cfg: build_state_pass(c, bf, dump_dir=d), need, SM90))
        if not kda:   # GVA: the token-factor build reads the call's q / k at hv // group
            out.append(Variant(op, f"{tag}_state_forward_init_final_gva2",
                               lambda d: build_state_pass(StateConfig(False, "forward", True, True, True, group=2), bf,
                                                          dump_dir=d), (WGMMA, TMA_LOAD), SM90))
        out.append(Variant(op, f"{tag}_state_forward_fp16",
                           lambda d, kda=kda: build_state_pass(StateConfig(kda, "forward", True, True, not kda), f16,
                                                               dump_dir=d), (WGMMA, TMA_LOAD), SM90))
    # split-KV decode: the GQA groups of the benchmark grid, new tokens, paged, softcap, stream-K; the fixup's
    # own launch on every arch
    fixup = ("atom.global.acq_rel.add",)   # release before the count, acquire after (PTX's default scope: gpu)
    for cfg, io in [(DecodeConfig(group=8), bf), (DecodeConfig(group=4), bf), (DecodeConfig(group=1), f16),
                    (DecodeConfig(group=8, q_len=4), bf), (DecodeConfig(group=8, paged=True), bf),
                    (DecodeConfig(group=8, softcap=True), bf), (DecodeConfig(group=4, persistent=True), bf),
                    (DecodeConfig(group=4, longest_first=True), bf)]:
        name = (f"decode_g{cfg.group}_q{cfg.q_len}_{_dtype_tag(io)}" + ("_paged" if cfg.paged else "")
                + ("_softcap" if cfg.softcap else "") + ("_stream_k" if cfg.persistent else "")
                + ("_longest_first" if cfg.longest_first else ""))
        s_product = "m64n16k16" if cfg.paged else "m64n64k16"   # S per 16-token box (paged) or 64-token block
        need = (f"wgmma.mma_async.sync.aligned.{s_product}", "wgmma.mma_async.sync.aligned.m64n128k16", TMA_LOAD,
                "shfl.sync.bfly", "ex2.approx") + fixup + (("tanh.approx",) if cfg.softcap else ())
        out.append(Variant("decode_attention", name, lambda d, c=cfg, io=io: build_decode(c, io, dump_dir=d), need,
                           SM90))
        # the SM100 build of the same config: tcgen05 MMAs into TMEM, TMA boxes, tcgen05.st for O's correction
        need = TCGEN05 + ("tcgen05.st", TMA_LOAD, "ex2.approx") + fixup + (("tanh.approx",) if cfg.softcap else ())
        out.append(Variant("decode_attention", name, lambda d, c=cfg, io=io: build_decode(c, io, dump_dir=d), need,
                           SM100))
    for group, io in [(8, bf), (1, f16)]:
        out.append(Variant("decode_attention", f"decode_fixup_g{group}_{_dtype_tag(io)}",
                           lambda d, g=group, io=io: build_decode_fixup(g, io, dump_dir=d), ("ex2.approx", LD_GLOBAL_16B),
                           ANY))
    # the recurrent decode step (every arch): plain GDN; the engine form; GVA with a dense state and the gate in the
    # kernel (fp16, fp32 beta); KDA with every flag, a pool and speculative writes
    for name, cfg, io, gd, bd in [
            ("recurrent_gdn", RecurrentConfig(), bf, f32, bf),
            ("recurrent_gdn_dense_tokens4", RecurrentConfig(initial="dense", final="dense", tokens=4), bf, f32, bf),
            ("recurrent_gdn_dense_tokens8_tensor_cores", RecurrentConfig(initial="dense", final="dense", tokens=8,
                                                                      tensor_cores=True), bf, f32, bf),
            # the engine form (benchmarks/recurrent_decode.py) where the planner runs each step: 8 tokens on
            # tensor cores, 4 token by token
            ("recurrent_gdn_gva2_pool_l2norm_gate_tokens8_tensor_cores",
             RecurrentConfig(group=2, initial="pool", final="pool", l2norm=True, gate_in_kernel=True, a_log=True,
                             dt_bias=True, beta_sigmoid=True, tokens=8, tensor_cores=True), bf, bf, bf),
            ("recurrent_gdn_gva2_pool_l2norm_gate_tokens4",
             RecurrentConfig(group=2, initial="pool", final="pool", l2norm=True, gate_in_kernel=True, a_log=True,
                             dt_bias=True, beta_sigmoid=True, tokens=4), bf, bf, bf),
            ("recurrent_kda_pool_l2norm_tokens1", RecurrentConfig(kda=True, initial="pool", final="pool", l2norm=True,
                                                                  tokens=1), bf, f32, bf),
            ("recurrent_gdn_gva4_dense_gate_fp16", RecurrentConfig(group=4, initial="dense", final="dense",
                                                                   gate_in_kernel=True, a_log=True, dt_bias=True),
             f16, f32, f32),
            ("recurrent_kda_gva2_varlen_spec_pool_all_flags",
             RecurrentConfig(kda=True, group=2, varlen=True, initial="pool", final="pool", spec=True, l2norm=True,
                             gate_in_kernel=True, a_log=True, dt_bias=True, lower_bound=True, beta_sigmoid=True,
                             neg_eigval=True), bf, bf, bf)]:
        need = ("bar.sync", "ex2.approx") + (("shfl.sync.bfly", "rsqrt.approx") if cfg.l2norm else ())
        if cfg.tensor_cores:
            need += ("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32", "cvt.rna.tf32.f32")
        else:
            need += ("shfl.sync.bfly",)
        out.append(Variant("fused_recurrent", name, lambda d, c=cfg, io=io, gd=gd, bd=bd: build_recurrent_step(
            c, io, gd, bd, dump_dir=d), need, ANY))
    # use_qk_l2norm_in_kernel: q and k normalized in one launch (every arch)
    for io in (bf, f16):
        out.append(Variant("l2norm", f"qk_l2norm_{_dtype_tag(io)}", lambda d, io=io: build_qk_l2norm(io, dump_dir=d),
                           ("shfl.sync.bfly", "rsqrt.approx"), ANY))
    for gather in (True, False):   # the chunked forward's state pool (every arch)
        out.append(Variant("state_pool", f"state_pool_{'gather' if gather else 'scatter'}",
                           lambda d, gather=gather: build_state_pool_copy(gather, dump_dir=d), (LD_GLOBAL_16B,), ANY))
    from schedulers.probe import probe_variants

    return out + probe_variants(Variant)
