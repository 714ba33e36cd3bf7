"""Every compiled variant of the project, for `python -m cute_kernels compile` and the compile tests.

A variant is (op, name, compile function, PTX patterns that must appear). Compile functions build fake
tensors, so this needs no GPU; `CUTE_DSL_ARCH` must be set before the first `import cutlass`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Variant:
    op: str
    name: str
    compile: Callable  # (dump_dir) -> runtime.compile.Compiled
    ptx_must_have: tuple[str, ...] = ()       # substrings, any arch
    ptx_must_have_sm90: tuple[str, ...] = ()
    ptx_must_have_sm100: tuple[str, ...] = ()
    archs: tuple[str, ...] = ("sm_90a", "sm_100a")   # an SM90 mainloop (wgmma) has no sm_100a build

    def required(self, arch: str) -> tuple[str, ...]:
        extra = self.ptx_must_have_sm90 if arch.startswith("sm_90") else self.ptx_must_have_sm100
        return (f".target {arch}",) + self.ptx_must_have + extra


def all_variants(arch: str | None = None) -> list[Variant]:
    """Every variant, or those built for `arch`."""
    return [v for v in _variants() if arch is None or arch in v.archs]


def _variants() -> list[Variant]:
    import torch

    from .ops.merge import compile_affine_merge, compile_lse_merge

    out = []
    so = "starts_only"
    for k, v, init, impl, *flag in [
            (128, 128, True, "simt"), (128, 128, False, "simt"), (64, 64, True, "simt"),
            (128, 128, True, "staged"), (64, 64, False, "staged"), (128, 128, False, "staged", so),
            (128, 128, True, "prefetch"), (128, 128, False, "prefetch"), (64, 64, False, "prefetch"),
            (128, 128, False, "prefetch", so), (128, 128, True, "prefetch", so),
            (128, 128, True, "ring"), (128, 128, False, "ring"), (64, 64, False, "ring"), (128, 128, False, "ring", so),
            (128, 128, True, "regs"), (128, 128, False, "regs", so)]:
        staged = impl != "simt"
        starts_only = bool(flag)
        out.append(Variant(
            "affine_merge", f"affine_merge_k{k}_v{v}{'_init' if init else ''}{'' if impl == 'simt' else '_' + impl}"
            + ("_starts" if starts_only else ""),
            lambda d, k=k, v=v, init=init, impl=impl, so=starts_only: compile_affine_merge(k, v, init, impl,
                                                                                           dump_dir=d, starts_only=so),
            # 16-byte global loads: ld.global.v4.b32 (sm_90a) or ld.global.v2.b64 (sm_100a, staged copy); the ring
            # streams M by 16-byte cp.async instead
            ptx_must_have=("fma.rn.f32", "bar.sync") + (("ld.shared.v4",) if staged else ("ld.global.v4",))
            + (("cp.async.ca.shared.global", "cp.async.wait_group") if impl == "ring" else ())
            + (("shfl.sync.bfly", "st.shared.v") if impl == "regs" else ()),   # 16-byte state stores
            ptx_must_have_sm90=() if impl == "ring" else ("ld.global.v4",),
        ))
    for impl in ("prefetch", "staged", "regs"):   # as the two-phase state pass runs them: programmatic dependent launch
        out.append(Variant(
            "affine_merge", f"affine_merge_k128_v128_{impl}_starts_pdl",
            lambda d, impl=impl: compile_affine_merge(128, 128, False, impl, dump_dir=d, starts_only=True, pdl=True),
            ptx_must_have=("griddepcontrol.wait", "griddepcontrol.launch_dependents", "fma.rn.f32"),
        ))
    out.append(Variant(   # STATE_EARLY_CORRECTION's merge: every start state published (release add) as stored
        "affine_merge", "affine_merge_k128_v128_regs_publish_pdl",
        lambda d: compile_affine_merge(128, 128, False, "regs", dump_dir=d, pdl=True, publish=True),
        ptx_must_have=("griddepcontrol.wait", "fence.acq_rel.gpu", "atom.global.release.add", "shfl.sync.bfly"),
    ))
    out.append(Variant(
        "affine_merge", "affine_merge_k128_v128_init_tc_publish_pdl",
        lambda d: compile_affine_merge(128, 128, True, "tc", dump_dir=d, pdl=True, publish=True),
        ptx_must_have=("griddepcontrol.wait", "fence.acq_rel.gpu", "atom.global.release.add",
                       "wgmma.mma_async.sync.aligned.m64n128k16"),
        archs=("sm_90a",),
    ))
    out.append(Variant(   # diagnostics: the regs merge's cycles per phase (scripts/time_merges.py profile)
        "affine_merge", "affine_merge_k128_v128_regs_profile",
        lambda d: compile_affine_merge(128, 128, False, "regs", dump_dir=d, profile=True),
        ptx_must_have=("%clock64", "shfl.sync.bfly", "fma.rn.f32"),
    ))
    out.append(Variant(
        "affine_merge", "affine_merge_k128_v128_tc_starts_pdl",
        lambda d: compile_affine_merge(128, 128, False, "tc", dump_dir=d, starts_only=True, pdl=True),
        ptx_must_have=("griddepcontrol.wait", "wgmma.mma_async.sync.aligned.m64n128k16"),
        archs=("sm_90a",),
    ))
    for init, so in [(True, False), (False, True), (False, False)]:   # the tensor-core chain (SM90 only)
        out.append(Variant(
            "affine_merge", f"affine_merge_k128_v128{'_init' if init else ''}_tc" + ("_starts" if so else ""),
            lambda d, init=init, so=so: compile_affine_merge(128, 128, init, "tc", dump_dir=d, starts_only=so),
            ptx_must_have=("wgmma.mma_async.sync.aligned.m64n128k16", "mbarrier.try_wait"),
            archs=("sm_90a",),
        ))
    for dim, dt in [(128, torch.bfloat16), (128, torch.float16), (128, torch.float32), (64, torch.bfloat16)]:
        tag = str(dt).replace("torch.", "")
        out.append(Variant(
            "lse_merge", f"lse_merge_d{dim}_{tag}",
            lambda d, dim=dim, dt=dt: compile_lse_merge(dim, dt, dump_dir=d),
            ptx_must_have=("ld.global.v4", "ex2.approx"),
        ))
    from .ops.linear_attention import compile_gdn_sm90

    for io, beta, init, final in [
        (torch.bfloat16, torch.bfloat16, True, True),
        (torch.bfloat16, torch.bfloat16, False, False),
        (torch.float16, torch.float32, True, True),
    ]:
        name = (f"gdn_fwd_sm90_{str(io)[6:]}_beta{str(beta)[6:]}"
                f"{'_init' if init else ''}{'_final' if final else ''}")
        out.append(Variant(
            "chunk_gated_delta_rule", name,
            lambda d, io=io, beta=beta, init=init, final=final: compile_gdn_sm90(io, beta, init, final, dump_dir=d),
            ptx_must_have=("wgmma.mma_async", "cp.async.bulk.tensor", "setmaxnreg.inc", "setmaxnreg.dec"),
            archs=("sm_90a",),
        ))
    out.append(Variant(   # the defaults: per-element passes in 16-byte vectors (KDA_VEC), gates prefetched (KDA_PREFETCH)
        "chunk_kda", "kda_fwd_sm90_bfloat16_init_final",
        lambda d: compile_gdn_sm90(torch.bfloat16, torch.bfloat16, True, True, kda=True, dump_dir=d),
        ptx_must_have=("wgmma.mma_async.sync.aligned.m64n16k16", "cp.async.bulk.tensor", "setmaxnreg.inc",
                       "st.shared.v4", "ld.shared.v4", "cp.async.ca.shared.global", "cp.async.wait_group"),
        archs=("sm_90a",),
    ))
    out.append(Variant(   # KDA_VEC=0 KDA_PREFETCH=0: one element per thread and step, gates loaded in the chunk
        "chunk_kda", "kda_fwd_sm90_bfloat16_scalar",
        lambda d: compile_gdn_sm90(torch.bfloat16, torch.bfloat16, False, True, kda=True, dump_dir=d, vec=False,
                                   prefetch=False),
        ptx_must_have=("wgmma.mma_async.sync.aligned.m64n16k16", "cp.async.bulk.tensor", "setmaxnreg.inc"),
        archs=("sm_90a",),
    ))
    for kda in (False, True):
        for mode in ("summary", "segment_outputs"):
            out.append(Variant(
                "chunk_kda" if kda else "chunk_gated_delta_rule", f"{'kda' if kda else 'gdn'}_fwd_sm90_bfloat16_{mode}",
                # the segmented forward's variants: summary (no start state, no o) and outputs storing the final
                lambda d, mode=mode, kda=kda: compile_gdn_sm90(torch.bfloat16, torch.bfloat16, mode != "summary",
                                                               mode != "summary", kda=kda, mode=mode, dump_dir=d),
                ptx_must_have=("wgmma.mma_async", "cp.async.bulk.tensor", "setmaxnreg.inc"),
                archs=("sm_90a",),
            ))
    from .ops.two_phase import compile_chunk_prep, compile_segment_correction, compile_state_pass

    for kda in (False, True):   # the two-phase path (issue 5, experimental): phase 1 and phase 2
        op, tag = ("chunk_kda", "kda") if kda else ("chunk_gated_delta_rule", "gdn")
        out.append(Variant(
            op, f"{tag}_chunk_prep_sm90_bfloat16",
            lambda d, kda=kda: compile_chunk_prep(torch.bfloat16, torch.bfloat16, kda, slim=False, dump_dir=d,
                                                  pdl=True, row_anchors=kda, tma_out=kda, solve_mma=kda),
            ptx_must_have=("wgmma.mma_async", "cp.async.bulk.tensor", "setmaxnreg.inc", "st.global.v4",
                           "griddepcontrol.launch_dependents")
            # KDA: the row-anchored Akk / Aqk's band products (64 x 48 and 64 x 32), terms stored by TMA, the solve's
            # doubling levels as tf32 mma.sync products
            + (("wgmma.mma_async.sync.aligned.m64n48k16", "cp.async.bulk.tensor.3d.global.shared::cta",
                "cp.async.bulk.wait_group.read", "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32",
                "cvt.rna.tf32.f32") if kda else ()),
            archs=("sm_90a",),
        ))
        if not kda:   # GDN's slim phase 1: two CTAs per SM, 288 threads, no register reallocation; raw: without
            # the gated q / k copies (GDN_RAW_QK, the default), the per-token factors in one 16-byte store per row
            # (trio: that build with three CTAs per SM, PREP_TRIO; mma: its solve's doubling levels as tf32
            # mma.sync products, PREP_SOLVE_MMA, the default; one trio build without it)
            for raw, trio, mma in ((False, False, True), (True, False, True), (True, True, False),
                                   (True, True, True)):
                out.append(Variant(
                    op, f"{tag}_chunk_prep_sm90_bfloat16_slim" + ("_raw" if raw else "") + ("_trio" if trio else "")
                    + ("_mma" if mma else ""),
                    lambda d, raw=raw, trio=trio, mma=mma: compile_chunk_prep(
                        torch.bfloat16, torch.bfloat16, False, slim=True, dump_dir=d, pdl=True, raw_qk=raw, trio=trio,
                        solve_mma=mma),
                    ptx_must_have=("wgmma.mma_async", "cp.async.bulk.tensor", "st.global.v4",
                                   f".minnctapersm {3 if trio else 2}", ".reqntid 288",
                                   "griddepcontrol.launch_dependents")
                    + (("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32", "cvt.rna.tf32.f32") if mma else ()),
                    archs=("sm_90a",),
                ))
            # GDN_FOLD: the trio build writing W2 = T^T kg and A1 = Aqk T instead of w, u and Aqk (no v load)
            out.append(Variant(
                op, f"{tag}_chunk_prep_sm90_bfloat16_slim_raw_trio_mma_fold",
                lambda d: compile_chunk_prep(torch.bfloat16, torch.bfloat16, False, slim=True, dump_dir=d, pdl=True,
                                             raw_qk=True, trio=True, solve_mma=True, fold=True),
                ptx_must_have=("wgmma.mma_async", "cp.async.bulk.tensor", "st.global.v4", ".minnctapersm 3",
                               ".reqntid 288", "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32"),
                archs=("sm_90a",),
            ))
        else:   # KDA's phase 1 builds with the row-anchored Akk / Aqk by default (m64n48 / n32 band products);
            # still selectable: the column form (CUTE_KERNELS_KDA_ROW_ANCHORS=0) and the row-anchored build with
            # its terms stored by threads (CUTE_KERNELS_PREP_TMA_OUT=0)
            # and the row-anchored build with its solve's doubling levels on the CUDA cores (PREP_SOLVE_MMA=0; the
            # default build has them as tf32 mma.sync products)
            mma = ("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32", "cvt.rna.tf32.f32")
            for suffix, switch, extra in (("columns", {"row_anchors": False}, ()),
                                          ("thread_out", {"tma_out": False, "solve_mma": True}, mma),
                                          ("cuda_solve", {"solve_mma": False}, ())):
                out.append(Variant(
                    op, f"{tag}_chunk_prep_sm90_bfloat16_{suffix}",
                    lambda d, switch=switch: compile_chunk_prep(torch.bfloat16, torch.bfloat16, True, dump_dir=d,
                                                                pdl=True, **switch),
                    ptx_must_have=("wgmma.mma_async", "cp.async.bulk.tensor", "st.global.v4") + extra,
                    archs=("sm_90a",),
                ))
            # KDA_FOLD: qg, kE = k 2^G, W2 = T^T kg and A1 = Aqk T (no v load, no u), by TMA and by threads
            for suffix, tma in (("", True), ("_thread_out", False)):
                out.append(Variant(
                    op, f"{tag}_chunk_prep_sm90_bfloat16_fold{suffix}",
                    lambda d, tma=tma: compile_chunk_prep(torch.bfloat16, torch.bfloat16, True, dump_dir=d, pdl=True,
                                                          tma_out=tma, solve_mma=True, fold=True),
                    ptx_must_have=("wgmma.mma_async", "cp.async.bulk.tensor", "st.global.v4") + mma
                    + (("cp.async.bulk.tensor.3d.global.shared::cta",) if tma else ()),
                    archs=("sm_90a",),
                ))
            # KDA_FOLD's phase 1 with a two-stage q / k ring (KDA_PREP_STAGES=2): two full and two empty barriers
            out.append(Variant(
                op, f"{tag}_chunk_prep_sm90_bfloat16_fold_stages2",
                lambda d: compile_chunk_prep(torch.bfloat16, torch.bfloat16, True, dump_dir=d, pdl=True,
                                             tma_out=True, solve_mma=True, fold=True, stages=2),
                ptx_must_have=("wgmma.mma_async", "cp.async.bulk.tensor", "st.global.v4",
                               "cp.async.bulk.tensor.3d.global.shared::cta") + mma,
                archs=("sm_90a",),
            ))
            # the overlapped path's phase 1 with KDA_FOLD's terms (OVERLAP_FOLD): publishing, stored by threads
            out.append(Variant(
                op, f"{tag}_chunk_prep_sm90_bfloat16_fold_publish",
                lambda d: compile_chunk_prep(torch.bfloat16, torch.bfloat16, True, dump_dir=d, pdl=True,
                                             publish=True, solve_mma=True, fold=True),
                ptx_must_have=("wgmma.mma_async", "cp.async.bulk.tensor", "st.global.v4", "fence.acq_rel.gpu",
                               "atom.global.release.add") + mma,
                archs=("sm_90a",),
            ))
        # The overlapped path: phase 1 publishing per-chunk flags (GDN's builds) and the state pass waiting on them
        # (KDA's gated build, GDN's raw one); the flag code is the same for both ops. GDN's raw overlapped path
        # (OVERLAP_RAW): phase 1's raw build with three CTAs per SM, the raw state pass with three ring stages.
        if not kda:
            out.append(Variant(
                op, f"{tag}_chunk_prep_sm90_bfloat16_publish",
                lambda d: compile_chunk_prep(torch.bfloat16, torch.bfloat16, False, slim=False, dump_dir=d,
                                             pdl=True, publish=True),
                ptx_must_have=("wgmma.mma_async", "cp.async.bulk.tensor", "fence.acq_rel.gpu",
                               "atom.global.release.add"),
                archs=("sm_90a",),
            ))
            out.append(Variant(
                op, f"{tag}_chunk_prep_sm90_bfloat16_slim_raw_trio_publish",
                lambda d: compile_chunk_prep(torch.bfloat16, torch.bfloat16, False, slim=True, dump_dir=d,
                                             pdl=True, publish=True, raw_qk=True, trio=True, solve_mma=True,
                                             secondary=True),
                ptx_must_have=("wgmma.mma_async", "cp.async.bulk.tensor", "fence.acq_rel.gpu",
                               "atom.global.release.add", ".minnctapersm 3", ".reqntid 288", "griddepcontrol.wait",
                               "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32"),
                archs=("sm_90a",),
            ))
            out.append(Variant(
                op, f"{tag}_state_pass_sm90_bfloat16_rs_raw_consume",
                lambda d: compile_state_pass(torch.bfloat16, False, True, True, dump_dir=d, consume=True,
                                             raw_qk=True, rs=True, ring_decay=True, num_stages=3, pair=False,
                                             tma_o=False, u_fast=False, pdl=True),
                ptx_must_have=("wgmma.mma_async.sync.aligned.m64n128k16", "cp.async.bulk.tensor",
                               "ld.acquire.gpu.global", "vote.sync.ballot", "fence.proxy.async.global",
                               "ld.global.v4.b32", "trap;"),   # trap: the bounded spin (kernels/spin.py)
                archs=("sm_90a",),
            ))
            # OVERLAP_SHARE: the same state pass with room for a phase-1 trio CTA on its SM (two stages, launched
            # for two CTAs per SM: 128 registers per thread, the consumer raised to 216)
            out.append(Variant(
                op, f"{tag}_state_pass_sm90_bfloat16_rs_raw_consume_share",
                lambda d: compile_state_pass(torch.bfloat16, False, True, True, dump_dir=d, consume=True,
                                             raw_qk=True, rs=True, ring_decay=True, num_stages=2, pair=False,
                                             tma_o=False, u_fast=False, pdl=True, share=True),
                ptx_must_have=("wgmma.mma_async.sync.aligned.m64n128k16", "cp.async.bulk.tensor",
                               "ld.acquire.gpu.global", ".minnctapersm 2", "setmaxnreg.inc.sync.aligned.u32 \t216;",
                               "setmaxnreg.dec.sync.aligned.u32 \t40;", "trap;"),
                archs=("sm_90a",),
            ))
        else:
            out.append(Variant(
                op, f"{tag}_state_pass_sm90_bfloat16_consume",
                lambda d: compile_state_pass(torch.bfloat16, True, True, True, dump_dir=d, consume=True),
                ptx_must_have=("wgmma.mma_async", "cp.async.bulk.tensor", "ld.acquire.gpu.global", "vote.sync.ballot",
                               "fence.proxy.async.global", "trap;"),
                archs=("sm_90a",),
            ))
        for mode, init, final in (("forward", True, True), ("summary", False, False),
                                  ("segment_outputs", True, True)):
            for rs in (False, True):   # rs: the state chain in registers (its S update is one m64n128 product)
                # rs compiles as the op runs it: exp(G_last) in the ring, o stored from registers
                out.append(Variant(
                    op, f"{tag}_state_pass_sm90_bfloat16" + ("" if mode == "forward" else "_" + mode)
                    + ("_rs" if rs else ""),
                    lambda d, kda=kda, mode=mode, init=init, final=final, rs=rs: compile_state_pass(
                        torch.bfloat16, kda, init, final, mode=mode, dump_dir=d, rs=rs, ring_decay=rs, tma_o=False,
                        pair=False, pdl=rs),
                    ptx_must_have=("wgmma.mma_async", "cp.async.bulk.tensor", "setmaxnreg.inc")
                    + (("wgmma.mma_async.sync.aligned.m64n128k16", "griddepcontrol.wait") if rs else ()),
                    archs=("sm_90a",),
                ))
            if not kda:   # GDN_RAW_QK's state pass: q, k and the per-token factors (16-byte loads by the producer)
                out.append(Variant(
                    op, f"{tag}_state_pass_sm90_bfloat16" + ("" if mode == "forward" else "_" + mode) + "_rs_raw",
                    lambda d, mode=mode, init=init, final=final: compile_state_pass(
                        torch.bfloat16, False, init, final, mode=mode, dump_dir=d, rs=True, ring_decay=True,
                        tma_o=False, pair=False, pdl=True, raw_qk=True),
                    ptx_must_have=("wgmma.mma_async.sync.aligned.m64n128k16", "cp.async.bulk.tensor",
                                   "ld.global.v4.b32", "griddepcontrol.wait"),
                    archs=("sm_90a",),
                ))
                # GDN_FOLD: R = v - diag(2^G) k S, then A1 R and W2^T R; one V block per CTA, or `pair` tiles
                # (STATE_PAIR: both V blocks, 384 threads, for multi-wave state passes)
                for suffix, pair, extra in (("_rs_fold", False, "griddepcontrol.wait"),
                                            ("_pair_fold", True, ".reqntid 384")):
                    out.append(Variant(
                        op, f"{tag}_state_pass_sm90_bfloat16" + ("" if mode == "forward" else "_" + mode) + suffix,
                        lambda d, mode=mode, init=init, final=final, pair=pair: compile_state_pass(
                            torch.bfloat16, False, init, final, mode=mode, dump_dir=d, rs=True, ring_decay=True,
                            tma_o=False, pair=pair, pdl=True, raw_qk=True, fold=True),
                        ptx_must_have=("wgmma.mma_async.sync.aligned.m64n128k16", "cp.async.bulk.tensor",
                                       "ld.global.v4.b32", extra),
                        archs=("sm_90a",),
                    ))
            out.append(Variant(   # pair: both V blocks of a tile in one CTA, two consumer warpgroups on one ring
                op, f"{tag}_state_pass_sm90_bfloat16" + ("" if mode == "forward" else "_" + mode) + "_pair",
                lambda d, kda=kda, mode=mode, init=init, final=final: compile_state_pass(
                    torch.bfloat16, kda, init, final, mode=mode, dump_dir=d, rs=True, ring_decay=True, tma_o=False,
                    u_fast=False, pair=True),
                ptx_must_have=("wgmma.mma_async.sync.aligned.m64n128k16", "cp.async.bulk.tensor", "setmaxnreg.inc",
                               ".reqntid 384"),
                archs=("sm_90a",),
            ))
        if not kda:   # the one-pass forward's correction (op-independent: o += qm S_0)
            out.append(Variant(
                "linear_attention", "segment_correction_sm90_bfloat16",
                lambda d: compile_segment_correction(torch.bfloat16, dump_dir=d, pdl=True),
                ptx_must_have=("wgmma.mma_async.sync.aligned.m64n128k16", "cp.async.bulk.tensor",
                               "mbarrier.try_wait", "ld.global.v4", "griddepcontrol.wait"),
                archs=("sm_90a",),
            ))
            out.append(Variant(   # STATE_EARLY_CORRECTION: spins on the merge's published counts
                "linear_attention", "segment_correction_sm90_bfloat16_early",
                lambda d: compile_segment_correction(torch.bfloat16, dump_dir=d, pdl=True, early=True),
                ptx_must_have=("wgmma.mma_async.sync.aligned.m64n128k16", "cp.async.bulk.tensor",
                               "ld.acquire.gpu", "atom.global.add", "griddepcontrol.launch_dependents", "trap;"),
                archs=("sm_90a",),
            ))
        # summary_o: the one-pass segmented forward's summary launch (the chain's outputs stored too: o from 0 by
        # the h_ext blocks, qm by the M blocks)
        out.append(Variant(
            op, f"{tag}_state_pass_sm90_bfloat16_summary_o" + ("" if kda else "_fold"),
            lambda d, kda=kda: compile_state_pass(
                torch.bfloat16, kda, False, False, mode="summary", dump_dir=d, rs=True, ring_decay=True,
                tma_o=False, u_fast=False, pair=False, pdl=True, raw_qk=not kda, fold=not kda, summary_o=True),
            ptx_must_have=("wgmma.mma_async.sync.aligned.m64n128k16", "cp.async.bulk.tensor", "griddepcontrol.wait"),
            archs=("sm_90a",),
        ))
        # lookback: the segmented forward in one launch (tickets, summary counts and end flags in global memory,
        # the link on tensor cores); GDN with the fold's terms, KDA with its plain ones; with an initial state
        # (every link has an M) and without (the first link is h_ext alone)
        for init in (True, False):
            out.append(Variant(
                op, f"{tag}_state_pass_sm90_bfloat16_lookback" + ("" if kda else "_fold") + ("" if init else "_noinit"),
                lambda d, kda=kda, init=init: compile_state_pass(
                    torch.bfloat16, kda, init, init, mode="lookback", dump_dir=d, rs=True, ring_decay=True,
                    tma_o=False, u_fast=False, pair=False, pdl=True, raw_qk=not kda, fold=not kda),
                ptx_must_have=("wgmma.mma_async.sync.aligned.m64n128k16", "cp.async.bulk.tensor",
                               "atom.global.add", "atom.global.release.add", "ld.acquire.gpu", "fence.acq_rel.gpu",
                               "st.release.gpu", "fence.proxy.async.global", "mbarrier.try_wait", "trap;"),
                archs=("sm_90a",),
            ))
        out.append(Variant(   # rs with u read at constant offsets (a switch, off until measured)
            op, f"{tag}_state_pass_sm90_bfloat16_rs_u_fast",
            lambda d, kda=kda: compile_state_pass(torch.bfloat16, kda, True, True, dump_dir=d, rs=True,
                                                  ring_decay=True, u_fast=True),
            ptx_must_have=("wgmma.mma_async.sync.aligned.m64n128k16", "cp.async.bulk.tensor"),
            archs=("sm_90a",),
        ))
        out.append(Variant(   # rs with o tiles leaving by TMA store (a switch, off by default)
            op, f"{tag}_state_pass_sm90_bfloat16_rs_tma_o",
            lambda d, kda=kda: compile_state_pass(torch.bfloat16, kda, True, True, dump_dir=d, rs=True,
                                                  ring_decay=True, tma_o=True),
            ptx_must_have=("wgmma.mma_async.sync.aligned.m64n128k16", "cp.async.bulk.tensor.3d.global.shared::cta",
                           "cp.async.bulk.wait_group.read"),
            archs=("sm_90a",),
        ))
        out.append(Variant(   # rs with the decays read by the consumer and o stored straight from registers
            op, f"{tag}_state_pass_sm90_bfloat16_rs_direct",
            lambda d, kda=kda: compile_state_pass(torch.bfloat16, kda, True, True, dump_dir=d, rs=True,
                                                  ring_decay=False, tma_o=False),
            ptx_must_have=("wgmma.mma_async.sync.aligned.m64n128k16", "cp.async.bulk.tensor", "setmaxnreg.inc"),
            archs=("sm_90a",),
        ))
        out.append(Variant(   # rs, diagnostics: clock64 stamps per phase of every chunk
            op, f"{tag}_state_pass_sm90_bfloat16_rs_profile",
            lambda d, kda=kda: compile_state_pass(torch.bfloat16, kda, False, False, dump_dir=d, rs=True,
                                                  profile=True, pair=False),
            ptx_must_have=("wgmma.mma_async.sync.aligned.m64n128k16", "clock64"),
            archs=("sm_90a",),
        ))
        out.append(Variant(   # rs with a 3-stage ring (fits once S, v_new and o leave shared memory)
            op, f"{tag}_state_pass_sm90_bfloat16_rs3",
            lambda d, kda=kda: compile_state_pass(torch.bfloat16, kda, True, True, dump_dir=d, rs=True, num_stages=3),
            ptx_must_have=("wgmma.mma_async.sync.aligned.m64n128k16", "cp.async.bulk.tensor", "setmaxnreg.inc"),
            archs=("sm_90a",),
        ))
    try:
        from schedulers.probe import probe_variants
    except ImportError:
        probe_variants = None
    if probe_variants is not None:
        out += probe_variants(Variant)
    return out
