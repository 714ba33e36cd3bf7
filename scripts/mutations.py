"""Planted bugs: proof that the test suite can see the state the forward carries.

    python scripts/mutations.py --cpu            # bugs in the references and the host code, CPU tests (CI-sized)
    python scripts/mutations.py --gpu            # bugs in the kernels, GPU tests (on the GPU machine)
    python scripts/mutations.py --list           # the catalog
    python scripts/mutations.py --cpu --only merge-m-zero --jobs 2

Each mutant is one textual edit of one source file (`old` -> `new`, `old` found exactly once). For every
mutant the script copies the tree to a temporary folder, applies the edit there (the working tree is never
touched), runs the tests that should catch it, and counts the failing ones. First it runs the same tests on an
unmutated copy: they must all pass, or a "caught" count would mean nothing. It prints one line per bug,
`caught by N tests`, with the count of each site, and exits 1 if any bug survives at any of its sites (2 if the
baseline fails or an edit no longer applies: the catalog must follow the code).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REF = "cute_kernels/reference/linear_attention.py"
OPS = "cute_kernels/ops/linear_attention.py"
HOST = "schedulers/host.py"


@dataclass(frozen=True)
class Mutant:
    bug: str        # the bug this plants (several sites may plant the same bug)
    site: str       # where, in a few words
    path: str       # the file, relative to the repository
    old: str        # text found exactly once in the file
    new: str        # its replacement
    tests: tuple    # test selections, each "FILE" or "FILE@K-EXPRESSION" (one pytest run each)
    gpu: bool = False


REF_FORMS = ("tests/test_reference.py@forms_agree or summaries or segmentation or frozen or kda_with or literal or scale",)
REF_MERGE = ("tests/test_reference.py@merge or forms_agree or segmentation",)
FUSED_HOST = ("tests/test_ops_host.py",)
TWO_PHASE_HOST = ("tests/test_two_phase.py@segmented_state_pass_orchestration or wiring or contract or token_factor",)
PATHS = "cute_kernels/paths/two_phase.py"
BENCH_PEERS = "tests/test_benchmarks.py@best_peer or flashinfer_adapter or merge_peers"
PLAN = "cute_kernels/plan/__init__.py"
MERGE_RUN = "cute_kernels/paths/merge.py"

STEP_REF = "cute_kernels/reference/recurrent_step.py"

CPU_MUTANTS = [
    # -- the inverse-first spec: the ungated inverse used without its gates
    Mutant("ungated inverse used ungated", "inverse-first chunk (reference, form='inverse_first')", REF,
           "X = gamma * X0", "X = X0",
           ("tests/test_reference.py@inverse_first",)),
    # -- the carry factor diag(exp(G_last)) S dropped
    Mutant("carry factor dropped", "chunked reference", REF,
           "S = _decay_by_last(S, t.decay_last, kda) + t.kg.transpose(-1, -2) @ v_new",
           "S = S + t.kg.transpose(-1, -2) @ v_new", REF_FORMS),
    Mutant("carry factor dropped", "chunk maps M_c (reference)", REF,
           "M[:, c] = _decay_by_last(eye.expand(n, H, K, K), t.decay_last, kda) - kgT @ t.w",
           "M[:, c] = eye.expand(n, H, K, K) - kgT @ t.w", REF_FORMS),
    Mutant("carry factor dropped", "state-pass spec (paths.two_phase.state_pass_torch)", PATHS,
           "S = (decay[..., None] if terms.kda else decay[..., None, None]) * S + update_key.transpose(-1, -2) @ v_new",
           "S = S + update_key.transpose(-1, -2) @ v_new", TWO_PHASE_HOST),
    # -- the merge: M zero, identity or transposed; h_ext dropped; the final state one segment early
    Mutant("M replaced by zero in the merge", "reference merge (the CPU tests' merge)", REF,
           "S = M[s] @ S + h[s]", "S = 0 * M[s] @ S + h[s]", REF_MERGE + FUSED_HOST + TWO_PHASE_HOST),
    Mutant("M replaced by I in the merge", "reference merge (the CPU tests' merge)", REF,
           "S = M[s] @ S + h[s]", "S = S + h[s]", REF_MERGE + FUSED_HOST + TWO_PHASE_HOST),
    Mutant("M transposed in the merge", "reference merge (the CPU tests' merge)", REF,
           "S = M[s] @ S + h[s]", "S = M[s].transpose(-1, -2) @ S + h[s]", REF_MERGE + FUSED_HOST + TWO_PHASE_HOST),
    Mutant("h_ext dropped", "reference merge (the CPU tests' merge)", REF,
           "S = M[s] @ S + h[s]", "S = M[s] @ S", REF_MERGE + FUSED_HOST + TWO_PHASE_HOST),
    Mutant("final state taken from the second-to-last segment", "reference merge", REF,
           "            S = M[s] @ S + h[s]\n        final[n] = S",
           "            S, prev = M[s] @ S + h[s], S\n        final[n] = prev if offs[n + 1] - offs[n] > 1 else S",
           REF_MERGE),
    Mutant("final state taken from the second-to-last segment", "tile table (schedulers)", HOST,
           "out.append(WorkTile(n, h, b, s, ns, seg.seg_offsets[n] + s, c0, c1, t0, t1))",
           "out.append(WorkTile(n, h, b, s, max(1, ns - 1), seg.seg_offsets[n] + s, c0, c1, t0, t1))",
           FUSED_HOST + TWO_PHASE_HOST),
    # -- a segment boundary shifted by one chunk: the summaries cover other chunks than the outputs
    Mutant("segment boundary shifted by one chunk", "fused summary launch (planner)", PLAN,
           "return schedule, summary_schedule(blocks2, schedule.segmentation, first_m=init)",
           "from schedulers import Segmentation\n"
           "    shifted = Segmentation([[c + (0 < i < len(b) - 1) for i, c in enumerate(b)]\n"
           "                            for b in schedule.segmentation.bounds])\n"
           "    return schedule, summary_schedule(blocks2, shifted, first_m=init)", FUSED_HOST),
    Mutant("segment boundary shifted by one chunk", "two-phase summary launch (StateRun)", PATHS,
           "summ = summary_schedule(problem_of(B, T, H, cu, num_blocks=4), seg, first_m=init, h_blocks=2)",
           "summ = summary_schedule(problem_of(B, T, H, cu, num_blocks=4), Segmentation(\n"
           "            [[c + (0 < i < len(b) - 1) for i, c in enumerate(b)] for b in seg.bounds]),\n"
           "            first_m=init, h_blocks=2)", TWO_PHASE_HOST),
    # -- the initial state ignored
    Mutant("initial state ignored", "op wiring (both paths)", OPS,
           "    init = initial_state is not None\n", "    init = False\n",
           FUSED_HOST + ("tests/test_two_phase.py@wiring",)),
    Mutant("initial state ignored", "reference start state", REF,
           "    if p.initial_state is None:\n        return p.k.new_zeros",
           "    if True:\n        return p.k.new_zeros", REF_FORMS),
    # -- scale ignored (K^-0.5 used)
    Mutant("scale ignored (K^-0.5 used)", "op wiring (both paths)", OPS,
           "scale = float(scale) if scale is not None else K ** -0.5", "scale = K ** -0.5", FUSED_HOST),
    Mutant("scale ignored (K^-0.5 used)", "reference", REF,
           "    if scale is None:\n        scale = K**-0.5", "    if True:\n        scale = K**-0.5", REF_FORMS),
    # -- beta ignored on one term
    Mutant("beta ignored on one term", "reference chunk terms: Akk without beta", REF,
           "Akk = beta[..., :, None] * Akk.tril(-1)", "Akk = Akk.tril(-1)", REF_FORMS + TWO_PHASE_HOST),
    # -- the last partial chunk's length taken as 64
    Mutant("last partial chunk's length taken as 64", "tile table (schedulers)", HOST,
           "t0, t1 = start + min(c0 * C, length), start + min(c1 * C, length)",
           "t0, t1 = start + min(c0 * C, length), start + c1 * C", FUSED_HOST + TWO_PHASE_HOST),
    Mutant("last partial chunk's length taken as 64", "state-pass spec (paths.two_phase.state_pass_torch)", PATHS,
           "    for t0 in range(0, T, C):\n        t1 = min(t0 + C, T)\n        L = t1 - t0\n",
           "    for t0 in range(0, T, C):\n        t1 = min(t0 + C, T)\n        L = C\n", TWO_PHASE_HOST),
    # -- forward-only ops: an input that requires grad must raise, not lose its gradient
    Mutant("requires-grad input accepted", "op wiring (chunked forward)", "cute_kernels/ops/linear_attention.py",
           "    check_no_grad(name, q=q, k=k, v=v, g=g, beta=beta, initial_state=initial_state)\n", "",
           ("tests/test_gdn_sm90.py@requires_grad",)),
    # -- torch.compile: the fake implementation must give the real outputs' shapes
    Mutant("fake output shape wrong", "chunked forward's fake (ops/torch_ops.py)", "cute_kernels/ops/torch_ops.py",
           "N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1", "N = B", ("tests/test_torch_ops.py",)),
    # -- FLA's gate arguments, checked and turned into the kernels' gate form
    Mutant("dt_bias ignored", "gate arguments (ops.linear_attention.gate_arguments)", OPS,
           "            bias = dt_bias.reshape(-1).float()", "            bias = None",
           ("tests/test_gdn_sm90.py@gate_arguments_match",)),
    Mutant("allow_neg_eigval ignored", "gate arguments (ops.linear_attention.gate_arguments)", OPS,
           'beta=("sigmoid2" if allow_neg_eigval else "sigmoid")',
           'beta=("sigmoid" if allow_neg_eigval else "sigmoid")', ("tests/test_gdn_sm90.py@gate_arguments_match",)),
    Mutant("gate form not passed to phase 1", "op wiring (ops.linear_attention.run)", OPS,
           "prep = PrepRun(prep_config(plan.kda, plan.prep_ctas_per_sm, group, gate)",
           "prep = PrepRun(prep_config(plan.kda, plan.prep_ctas_per_sm, group)",
           ("tests/test_ops_host.py@gate_arguments_reach",)),
    # -- SM100 budgets: the SM's TMEM is shared by its CTAs
    Mutant("KDA bands overlap in TMEM", "SM100 KDA band columns (kernels.sm100.budgets.KDA_BAND_COLS)",
           "cute_kernels/kernels/sm100/budgets.py", "KDA_BAND_COLS = (0, 64, 128, 160)",
           "KDA_BAND_COLS = (0, 48, 128, 160)", ("tests/test_sm100_fused_model.py@thread_mappings",)),
    Mutant("KDA band rows overlap in shared memory", "SM100 KDA band rows (kernels.sm100.budgets.KDA_BAND_ROWS)",
           "cute_kernels/kernels/sm100/budgets.py", "KDA_BAND_ROWS = (0, 64, 112, 144)",
           "KDA_BAND_ROWS = (0, 64, 112, 140)", ("tests/test_sm100_fused_model.py@thread_mappings",)),
    Mutant("TMEM budget checked for one CTA, not ctas_per_sm", "SM100 budgets (kernels.sm100.budgets.tmem_plan)",
           "cute_kernels/kernels/sm100/budgets.py", "if alloc * ctas_per_sm > TMEM_COLUMNS:",
           "if alloc > TMEM_COLUMNS:", ("tests/test_sm100_budgets.py",)),
    # -- graph-mode varlen: the tile table built on the device
    Mutant("last partial chunk dropped from the device table", "schedulers.host.sequence_table_on_device",
           "schedulers/host.py", "torch.div(end - start + chunk_size - 1, chunk_size",
           "torch.div(end - start, chunk_size", ("tests/test_gdn_sm90.py@device_table",)),
    # -- the decode step's spec: GVA's head map, the pool's -1
    Mutant("GVA heads tiled instead of grouped", "decode-step spec (reference.recurrent_step)", STEP_REF,
           "q, k = q.repeat_interleave(group, dim=2), k.repeat_interleave(group, dim=2)",
           "q, k = q.repeat(1, 1, group, 1), k.repeat(1, 1, group, 1)", ("tests/test_recurrent.py@spec_gva",)),
    Mutant("pool index -1 read as a slot", "decode-step spec (reference.recurrent_step)", STEP_REF,
           "                if idx >= 0:\n                    S = initial_state[idx].to(cd).clone()",
           "                S = initial_state[idx].to(cd).clone()", ("tests/test_recurrent.py@spec_pool",)),
    # -- the benchmark's peer adapters (a wrong conversion would time, and compare against, another problem)
    Mutant("peer gate passed in log space", "FlashInfer adapter (benchmarks.peers)", "benchmarks/peers.py",
           '"g": rows(x["g"]).float().exp(),', '"g": rows(x["g"]).float(),', (BENCH_PEERS,)),
    Mutant("peer state layout not converted", "FlashInfer adapter (benchmarks.peers)", "benchmarks/peers.py",
           "state.transpose(-1, -2)", "state", (BENCH_PEERS,)),
    Mutant("peer fields dropped from the JSON", "benchmarks.report.ROW_KEYS", "benchmarks/report.py",
           '"ours_graph_us", "peers", "best_peer", "speedup_vs_best",', '"ours_graph_us",',
           ("tests/test_benchmarks.py@round_trip",)),
    Mutant("slowest peer taken as the best", "benchmarks.report.summarize_peers", "benchmarks/report.py",
           "best = min(row[\"peers\"], key=row[\"peers\"].get)", "best = max(row[\"peers\"], key=row[\"peers\"].get)",
           (BENCH_PEERS,)),
    Mutant("decode parts joined in file order", "benchmarks.decode.join_parts", "benchmarks/decode.py",
           "[rows[k] for k in sorted(rows, key=lambda k: order.get(k, len(order)))]", "list(rows.values())",
           ("tests/test_benchmarks.py@decode_parts_join",)),
    Mutant("decode-step sweep hands run_cell one form", "benchmarks.recurrent_decode.main",
           "benchmarks/recurrent_decode.py", "    prepare = ours_forms(kda)\n", "    prepare = ours(kda)\n",
           ("tests/test_benchmarks.py@every_form_of_ours",)),
    Mutant("kernel overlap read as a gap", "scripts/decode_anatomy.py overlap report", "scripts/decode_anatomy.py",
           "gaps = [ks[i + 1][0] - ks[i][1] for i in range(len(ks) - 1)]",
           "gaps = [abs(ks[i + 1][0] - ks[i][1]) for i in range(len(ks) - 1)]",
           ("tests/test_decode_anatomy.py",)),
    Mutant("profiler's memsets counted as kernels", "scripts/decode_anatomy.py kernel_rows",
           "scripts/decode_anatomy.py", 'if e.name.lower().startswith(("memcpy", "memset")):',
           'if e.name.lower().startswith(("memcpy",)):', ("tests/test_decode_anatomy.py",)),
    Mutant("profiler's times taken as ns", "scripts/decode_anatomy.py kernel_rows", "scripts/decode_anatomy.py",
           "rows.append((round(e.time_range.start * 1e3), round(e.time_range.end * 1e3), e.name))",
           "rows.append((round(e.time_range.start), round(e.time_range.end), e.name))",
           ("tests/test_decode_anatomy.py",)),
    # -- the planners' measured rules
    Mutant("decode split planned at two CTAs per SM", "split-KV default plan (schedulers.splitkv)",
           "schedulers/splitkv.py", "SPLIT_CTAS_PER_SM = 1", "SPLIT_CTAS_PER_SM = 2",
           ("tests/test_splitkv.py@one_wave", "tests/test_decode.py@planned_from_the_bound")),
    Mutant("waves ignored by the split plan", "split-KV plan (schedulers.splitkv, waves=k)", "schedulers/splitkv.py",
           "p = plan_segments(problem, sm_count * self.waves, fill,",
           "p = plan_segments(problem, sm_count, fill,",
           ("tests/test_splitkv.py@waves",)),
    Mutant("long splits kept at one CTA per SM", "split-KV plan (schedulers.splitkv, long_split_kv)",
           "schedulers/splitkv.py", "if sum(deep.segments) > sum(p.segments):", "if sum(deep.segments) < 0:",
           ("tests/test_splitkv.py@long_splits", "tests/test_decode.py@default_plan_by_device_kind")),
    Mutant("long-split threshold ignored", "split-KV plan (schedulers.splitkv, long_split_kv)",
           "schedulers/splitkv.py", "long_chunks = max(min_chunks, ceil_div(self.long_split_kv, problem.chunk_size))",
           "long_chunks = min_chunks", ("tests/test_splitkv.py@long_splits",
                                        "tests/test_decode.py@default_plan_by_device_kind")),
    Mutant("device kind's long splits dropped", "decode planner (ops.decode.plan_decode)",
           "cute_kernels/ops/decode.py", "SplitKVScheduler(long_split_kv=LONG_SPLIT_KV.get(kind))",
           "SplitKVScheduler()", ("tests/test_decode.py@default_plan_by_device_kind",)),
    Mutant("merge batch of 16 for any split count", "decode planner (ops.decode.merge_batch)",
           "cute_kernels/ops/decode.py", "if b >= splits or b == DECODE_MERGE_BATCHES[-1]",
           "if b == DECODE_MERGE_BATCHES[-1]", ("tests/test_decode.py@merge_batch_covers",)),
    Mutant("long splits keep the 2-stage ring", "decode planner (ring_stages)", "cute_kernels/ops/decode.py",
           "return 3 if deep is not None and bound >= deep * splits else 2", "return 2",
           ("tests/test_decode.py@deeper_ring",)),
    Mutant("longest-first tiles for short splits too", "decode planner (longest_first)",
           "cute_kernels/ops/decode.py", " and bound >= LONGEST_FIRST_MIN_KV * splits", "",
           ("tests/test_decode.py@longest_first_where",)),
    Mutant("tensor-core step from 2 tokens", "decode step planner (ops.recurrent.use_tensor_cores)",
           "cute_kernels/ops/recurrent.py", "TC_MIN_TOKENS = 5", "TC_MIN_TOKENS = 2",
           ("tests/test_recurrent.py@measured_faster",)),
    Mutant("tensor-core step on any grid", "decode step planner (ops.recurrent.use_tensor_cores)",
           "cute_kernels/ops/recurrent.py", "and items >= TC_MIN_ITEMS", "",
           ("tests/test_recurrent.py@measured_faster",)),
]

# GPU: bugs planted in the kernels (and the launches' host side), each against a few GPU tests that must catch it.
# Selections stay small: every mutant compiles the kernels its tests run.
STATE = "cute_kernels/kernels/sm90/state_pass.py"
FUSED = "cute_kernels/kernels/sm90/fused.py"
PREP = "cute_kernels/kernels/sm90/chunk_prep.py"
LOCAL = "cute_kernels/kernels/sm90/chunk_local.py"
MATH = "cute_kernels/kernels/chunk_math.py"
SIMT_MERGE = "cute_kernels/kernels/merge.py"
TC_MERGE = "cute_kernels/kernels/sm90/affine_merge_tc.py"
G_STATE = ("tests/test_two_phase.py@state_pass_kernel and 4096 and weak",)   # g = 0 would hide the carry factor
G_FUSED = ("tests/test_gdn_sm90.py@long_sequence and fused and weak and True",
           "tests/test_gdn_sm90.py@matches_reference and fused and True and 100 and not 1000")   # unsplit
G_TWO = ("tests/test_gdn_sm90.py@long_sequence and two_phase and weak and True",)
G_SEG = ("tests/test_two_phase.py@two_phase_gate_regimes and zero and 8 and True",
         "tests/test_segmented.py@segmented_matches and weak and 8 and True")
G_MERGE = ("tests/test_merge.py@affine_merge_matches_reference or long_chain",) + G_SEG
G_SCALE = ("tests/test_gdn_sm90.py@scale_final_state_and_l2norm and 300",)
G_PREP = ("tests/test_two_phase.py@prep_kernel_matches and 1000",)
G_TAIL = ("tests/test_gdn_sm90.py@varlen and long-and-short and weak and True",)
STEP = "cute_kernels/kernels/recurrent_step.py"
FIXUP = "cute_kernels/kernels/decode_fixup.py"
G_DECODE = ("tests/test_decode.py@contiguous_gqa and 32-8",)
G_DECODE_PAGED = ("tests/test_decode.py@paged and 16",)
G_DECODE_CAUSAL = ("tests/test_decode.py@multi_token and 4 and False",)
G_DECODE_NAN = ("tests/test_decode.py@nan_past and split-kv",)
DECODE_SM90 = "cute_kernels/kernels/sm90/decode.py"
GPU_MUTANTS = [
    Mutant("carry factor dropped", "state pass (GDN)", STATE, "acc_s[i] = acc_s[i] * dg", "acc_s[i] = acc_s[i]",
           G_STATE, True),
    Mutant("carry factor dropped", "state pass (KDA)", STATE, "acc_s[i] = acc_s[i] * sEg[kk, stage]",
           "acc_s[i] = acc_s[i]", G_STATE, True),
    Mutant("carry factor dropped", "fused kernel (GDN)", FUSED, "acc_s[i] = acc_s[i] * decay_last",
           "acc_s[i] = acc_s[i]", G_FUSED, True),
    Mutant("carry factor dropped", "fused kernel (KDA)", FUSED,
           "acc_s[i] = acc_s[i] * cute.math.exp2(sGL[r], fastmath=True)", "acc_s[i] = acc_s[i]", G_FUSED, True),
    Mutant("M replaced by zero in the merge", "regs merge", SIMT_MERGE, "mv = m_cur[16 * i + 4 * q + e]",
           "mv = Float32(0.0) * m_cur[16 * i + 4 * q + e]", G_MERGE, True),
    Mutant("M replaced by zero in the merge", "tc merge", TC_MERGE, "            apply = slot != first\n",
           "            apply = slot < first\n", G_MERGE, True),
    Mutant("M replaced by I in the merge", "regs merge", SIMT_MERGE, "cur[j] = part[j] + h_cur[j]",
           "cur[j] = cur[j] + h_cur[j]", G_MERGE, True),
    Mutant("M replaced by I in the merge", "tc merge", TC_MERGE,
           "                nxt[i] = sH[kk, vv, stage]\n            apply = slot != first\n",
           "                nxt[i] = sH[kk, vv, stage] + acc[i]\n            apply = slot < first\n", G_MERGE, True),
    Mutant("M transposed in the merge", "the paths' merge launch", MERGE_RUN,
           "self.fn(M, h_ext, self.offsets,", "self.fn(M.transpose(-1, -2).contiguous(), h_ext, self.offsets,",
           G_SEG, True),
    Mutant("h_ext dropped", "regs merge", SIMT_MERGE, "cur[j] = part[j] + h_cur[j]", "cur[j] = part[j]", G_MERGE,
           True),
    Mutant("h_ext dropped", "tc merge", TC_MERGE, "                nxt[i] = sH[kk, vv, stage]\n",
           "                nxt[i] = Float32(0.0)\n", G_MERGE, True),
    Mutant("final state taken from the second-to-last segment", "state pass", STATE,
           "            if work.is_last_segment:\n                seq = work.seq",
           "            if work.segment == work.num_segments - 2 or work.num_segments == 1:\n"
           "                seq = work.seq", G_SEG[:1], True),
    Mutant("final state taken from the second-to-last segment", "fused kernel", FUSED,
           "                if work.is_last_segment:\n",
           "                if work.segment == work.num_segments - 2 or work.num_segments == 1:\n", G_SEG[1:], True),
    Mutant("segment boundary shifted by one chunk", "two-phase summary launch (StateRun)", PATHS,
           "summ = summary_schedule(problem_of(B, T, H, cu, num_blocks=4), seg, first_m=init, h_blocks=2)",
           "summ = summary_schedule(problem_of(B, T, H, cu, num_blocks=4), Segmentation(\n"
           "            [[c + (0 < i < len(b) - 1) for i, c in enumerate(b)] for b in seg.bounds]),\n"
           "            first_m=init, h_blocks=2)", G_SEG[:1], True),
    Mutant("initial state ignored", "state pass", STATE,
           "elif cutlass.const_expr(self.mode == \"segment_outputs\" or self.has_initial_state):",
           "elif cutlass.const_expr(self.mode == \"segment_outputs\"):", G_STATE + G_TWO, True),
    Mutant("initial state ignored", "fused kernel", FUSED,
           "                elif cutlass.const_expr(self.has_initial_state):\n",
           "                elif cutlass.const_expr(False):\n", G_FUSED, True),
    Mutant("scale ignored (K^-0.5 used)", "phase 1, compact build (GDN)", PREP,
           "                                   mKg, mA, mEg, scale, st, mFlags, chunks_per_seq, consumers, None)",
           "                                   mKg, mA, mEg, Float32(0.08838834764831845), st, mFlags, chunks_per_seq, "
           "consumers, None)", G_SCALE, True),
    Mutant("scale ignored (K^-0.5 used)", "fused kernel", FUSED,
           "mO, mS0, mSN,\n                          scale, st)",
           "mO, mS0, mSN,\n                          Float32(0.08838834764831845), st)", G_SCALE, True),
    Mutant("beta ignored on one term", "the solve's Xv (chunk_math)", MATH, "yv[e] = io(xb[e])",
           "yv[e] = io(xv)", G_PREP + G_FUSED, True),
    Mutant("raw gate rows converted for the wrong chunk", "fused kernel's gate rows (sm90.fused)", FUSED,
           "gv, gw, bv = local.math.gate_rows(ctid, t0 + C, tok_end, head, mG, mBeta)",
           "gv, gw, bv = local.math.gate_rows(ctid, t0 + 2 * C, tok_end, head, mG, mBeta)", G_FUSED, True),
    Mutant("beta's raw row read at g's place", "gate conversion (chunk_math.gate_values)", MATH,
           "beta = self.beta_value(Float32(bv))", "beta = self.beta_value(Float32(gv))", G_PREP + G_FUSED, True),
    Mutant("X_11's diagonal and upper part in the fp16 level's second product", "the solve (chunk_math)", MATH,
           "rA[e] = Float16(cutlass.select_(16 * mt + i > k, v, Float32(0.0)))", "rA[e] = Float16(v)",
           G_PREP + G_FUSED, True),
    Mutant("X_00's unit diagonal dropped in the fp16 level's first product", "the solve (chunk_math)", MATH,
           "v = cutlass.select_(k == c, Float32(1.0), v)", "v = cutlass.select_(k == c, Float32(0.0), v)",
           G_PREP + G_FUSED, True),
    Mutant("last partial chunk's length taken as 64", "state pass", STATE,
           "    if L > C:\n        L = Int32(C)\n    return t0, L", "    L = Int32(C)\n    return t0, L", G_TAIL, True),
    Mutant("last partial chunk's length taken as 64", "fused kernel", FUSED,
           "                L = local.math.rows_in(tok_end - t0)\n", "                L = Int32(C)\n", G_TAIL, True),
    # -- decode attention
    Mutant("fixup counter not reset for the next call", "decode fixup", FIXUP,
           "            mCounters[unit] = Int32(0)", "            pass", G_DECODE, True),
    Mutant("split weight dropped in the fixup", "decode fixup", FIXUP, "acc[j] = acc[j] + w * part[j]",
           "acc[j] = acc[j] + part[j]", G_DECODE, True),
    Mutant("merge batch's places past the last split weighted", "decode fixup (merge_unit)", FIXUP,
           "lses.append(cutlass.select_(s0 + u < nsplit, lse_part[slot0 + s, r], -Float32.inf))",
           "lses.append(lse_part[slot0 + s, r])", ("tests/test_decode.py@merge_batches",), True),
    Mutant("a row ranked against itself: no tile gets the longest row", "decode longest-first rank (ranked_row)",
           FIXUP, "(rows - 1 - j) > key:", "(rows - 1 - j) >= key:", ("tests/test_decode.py@longest_first",), True),
    Mutant("a longest-first tile's KV head dropped", "decode longest-first scheduler (unit_of)", FIXUP,
           "lambda u: row * num_kv_heads + u % num_kv_heads", "lambda u: row * num_kv_heads",
           ("tests/test_decode.py@longest_first",), True),
    Mutant("page table read as contiguous pages", "decode box row (decode_fixup.box_row)", FIXUP,
           "page = mPages[b, t // page_size]", "page = mPages[b, 0] + t // page_size", G_DECODE_PAGED, True),
    Mutant("new tokens' causal mask off by one", "decode score mask (decode_fixup.masked_score)", FIXUP,
           "visible = visible and t <= length - config.q_len + row // config.group",
           "visible = visible and t < length - config.q_len + row // config.group", G_DECODE_CAUSAL, True),
    Mutant("last partial block's length taken as 64", "decode split range (decode_fixup.split_range)", FIXUP,
           "    if kv_end > length:\n        kv_end = length\n", "", G_DECODE, True),
    Mutant("blocks loaded ahead from the next block's tokens", "decode producer (sm90.decode)", DECODE_SM90,
           "(work.chunk_start + j) * C, b0,", "(work.chunk_start + j + 1) * C, b0,", G_DECODE, True),
    Mutant("blocks loaded ahead past the length left in the ring", "decode consumer (sm90.decode)", DECODE_SM90,
           "stages = cutlass.max(blocks, self.ahead(work))", "stages = cutlass.max(blocks, 1)",
           ("tests/test_decode.py@lengths_below_the_planned_bound",), True),
    Mutant("the first V row past the cache length left as loaded", "decode consumer (sm90.decode)", DECODE_SM90,
           "if k * self.box + r >= valid:", "if k * self.box + r > valid:", G_DECODE_NAN, True),
    Mutant("V rows past the cache length left as loaded", "decode consumer (sm90.decode)", DECODE_SM90,
           "if t0 + C > length:", "if t0 + C > length + (1 << 30):", G_DECODE_NAN, True),
    # -- GVA in the chunked forward
    Mutant("GVA: q / k read at the value head", "the q / k / v producer (chunk-local)", LOCAL,
           "h = head if group == 1 else head // group", "h = head", ("tests/test_gdn_sm90.py@gva and 1000",), True),
    # -- the chunked forward's state pool
    Mutant("pool index -1 read as slot 0", "state-pool gather", "cute_kernels/kernels/state_pool.py",
           "                    buf.fill(0.0)",
           "                    cute.autovec_copy(cute.local_tile(pool[0, head, r, None], (VEC,), (c,)), buf)",
           ("tests/test_gdn_sm90.py@state_pool_in_place and 300",), True),
    # -- the recurrent decode step
    Mutant("tensor-core step products in plain tf32", "decode step on tensor cores (mma3)",
           "cute_kernels/kernels/tensor_core_step.py",
           "    c = mma_tf32(a[1], b[0], c)\n    c = mma_tf32(a[0], b[1], c)\n", "",
           ("tests/test_recurrent.py@state_is_fp32_accurate",), True),
    Mutant("tensor-core step: the inverse's column order swapped", "decode step on tensor cores (U)",
           "cute_kernels/kernels/tensor_core_step.py", "split_all((sInv[gid, 2 * tig], sInv[gid, 2 * tig + 1]))",
           "split_all((sInv[gid, 2 * tig + 1], sInv[gid, 2 * tig]))", ("tests/test_recurrent.py@tensor_core_step_matches_spec",),
           True),
    Mutant("l2norm eps taken as 1", "QKL2Norm", "cute_kernels/kernels/l2norm.py",
           "rstd = cute.math.rsqrt(ss + Float32(EPS))", "rstd = cute.math.rsqrt(ss + Float32(1.0))",
           ("tests/test_gdn_sm90.py@qk_l2norm_kernel",), True),
    Mutant("l2norm sums half a row", "QKL2Norm", "cute_kernels/kernels/l2norm.py",
           "for b in cutlass.range_constexpr(5):", "for b in cutlass.range_constexpr(4):",
           ("tests/test_gdn_sm90.py@qk_l2norm_kernel",), True),
    Mutant("dt_bias ignored in the chunked kernels", "gate loads (chunk_math.gate_value)", MATH,
           "            x = x + bias\n", "",
           ("tests/test_gdn_sm90.py@gate_arguments_against_fla and gate-",), True),
    Mutant("decode step reads the pool before the previous step is done", "recurrent step (PDL wait)", STEP,
           "        cute.arch.griddepcontrol_wait()\n", "", ("tests/test_recurrent.py@back_to_back_steps and not tensor",),
           True),
    Mutant("decode step reads the pool before the previous step is done", "tensor-core step (PDL wait)",
           "cute_kernels/kernels/tensor_core_step.py", "        cute.arch.griddepcontrol_wait()\n", "",
           ("tests/test_recurrent.py@back_to_back_steps and tensor",), True),
    Mutant("GVA heads tiled instead of grouped", "recurrent step", STEP, "h = hv // cfg.group", "h = hv % cfg.group",
           ("tests/test_recurrent.py@kernel_matches_spec and weak",), True),
    Mutant("final state written to the initial slot", "recurrent step", STEP, "slot = final_idx[n]",
           "slot = init_idx[n]", ("tests/test_recurrent.py@kernel_pool",), True),
    Mutant("speculative start ignores num_accepted_tokens", "recurrent step", STEP,
           "slot = init_idx[n, accepted[n] - 1]", "slot = init_idx[n, 0]",
           ("tests/test_recurrent.py@kernel_speculative",), True),
    Mutant("v of a group's second half staged from its first token", "recurrent step (staging)", STEP,
           "s_v[(tid + THREADS * m) // COLS, tid % COLS] = vx[m]",
           "s_v[(tid + THREADS * m) // COLS, tid % COLS] = vx[0]",
           ("tests/test_recurrent.py@kernel_matches_spec and weak and 8",), True),
    Mutant("every group staged from the sequence's first token", "recurrent step (groups)", STEP,
           "self.stage(staging, q, k, v, g, beta, dt_bias, bos + t0,",
           "self.stage(staging, q, k, v, g, beta, dt_bias, bos,",
           ("tests/test_recurrent.py@kernel_longer_than_a_group",), True),
]


def tracked_files(root: str) -> list[str]:
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=root, capture_output=True,
                         text=True, check=True).stdout.split("\n")
    return [f for f in out if f and not f.startswith("benchmarks/results/") and os.path.isfile(os.path.join(root, f))]


def make_copy(files: list[str], dst: str) -> None:
    for f in files:
        os.makedirs(os.path.dirname(os.path.join(dst, f)) or dst, exist_ok=True)
        shutil.copy2(os.path.join(ROOT, f), os.path.join(dst, f))


def apply(m: Mutant, root: str) -> None:
    path = os.path.join(root, m.path)
    text = open(path).read()
    n = text.count(m.old)
    if n != 1:
        raise LookupError(f"{m.path}: the text to replace occurs {n} times (need exactly 1): {m.old[:70]!r}")
    with open(path, "w") as f:
        f.write(text.replace(m.old, m.new))


def run_tests(root: str, selections: tuple, extra: list[str], timeout: int, threads: int) -> tuple[int, int, str]:
    """(failed + errors, passed, summary) over the test selections, run in `root` (one pytest run each) with
    `threads` CPU threads (parallel runs must not oversubscribe the cores: torch's spinning threads then crawl)."""
    # the copy first, then whatever the caller's path holds (the GPU machine's packages live there)
    pythonpath = os.pathsep.join([root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    env = dict(os.environ, PYTHONPATH=pythonpath, PYTHONDONTWRITEBYTECODE="1", OMP_NUM_THREADS=str(threads))
    env.pop("CUTE_KERNELS_AOT_WRITE", None)   # a mutant's kernels never go into a shared AOT directory
    failed = passed = 0
    lines = []
    for sel in selections:
        path, _, kexpr = sel.partition("@")
        cmd = [sys.executable, "-m", "pytest", path, *(["-k", kexpr] if kexpr else []), "-q", "-p",
               "no:cacheprovider", "--tb=no", "-rN", *extra]
        try:
            proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
            text = proc.stdout + proc.stderr
        except subprocess.TimeoutExpired:   # a hang (a spin that never ends) counts as caught
            failed += 1
            lines.append(f"{os.path.basename(path)}: timed out after {timeout} s")
            continue
        count = lambda word: sum(int(x) for x in re.findall(rf"(\d+) {word}\b", text))   # noqa: E731
        f, p = count("failed") + count("errors?"), count("passed")
        if not f and not p:   # collection failed, or nothing ran: an error, counted as one
            f = 1
        failed, passed = failed + f, passed + p
        lines.append(f"{os.path.basename(path)}: {f} failed, {p} passed")
    return failed, passed, "; ".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--cpu", action="store_true", help="bugs caught by CPU tests (references, host code)")
    mode.add_argument("--gpu", action="store_true", help="bugs in the kernels, caught by GPU tests")
    mode.add_argument("--list", action="store_true", help="print the catalog")
    ap.add_argument("--only", nargs="*", default=None, help="only the sites whose bug or site contains one of these")
    ap.add_argument("--jobs", type=int, default=2, help="mutants tested at once")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per mutant's test run")
    ap.add_argument("--pytest-args", default="", help="extra pytest arguments (e.g. --require-gpu)")
    args = ap.parse_args(argv)

    if args.list:
        for m in CPU_MUTANTS + GPU_MUTANTS:
            print(f"[{'gpu' if m.gpu else 'cpu'}] {m.bug}: {m.site} ({m.path}) -> {' | '.join(m.tests)}")
        return 0
    mutants = GPU_MUTANTS if args.gpu else CPU_MUTANTS
    if args.only:
        mutants = [m for m in mutants if any(s in m.bug or s in m.site for s in args.only)]
    if not mutants:
        print("no mutant selected")
        return 2
    extra = args.pytest_args.split()
    threads = max(1, (os.cpu_count() or 1) // args.jobs)
    files = tracked_files(ROOT)
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="mutations_") as tmp:
        base = os.path.join(tmp, "base")
        make_copy(files, base)
        for m in mutants:   # every edit must still apply before anything runs
            n = open(os.path.join(base, m.path)).read().count(m.old)
            if n != 1:
                print(f"catalog out of date: {m.bug} ({m.site}): {n} occurrences in {m.path} of {m.old[:70]!r}")
                return 2
        union = list(dict.fromkeys(sel for m in mutants for sel in m.tests))   # the baseline: every selection
        print(f"baseline: {len(union)} test selections on the unmutated tree ...", flush=True)

        def baseline(sel):
            return sel, run_tests(base, (sel,), extra, args.timeout, threads)

        with ThreadPoolExecutor(args.jobs) as pool:
            for sel, (failed, passed, line) in pool.map(baseline, union):
                if failed or not passed:
                    print(f"baseline fails ({sel}): {line}")
                    return 2
        print(f"baseline passes ({time.time() - t0:.0f} s)", flush=True)

        def trial(i_m):
            i, m = i_m
            root = os.path.join(tmp, f"m{i}")
            shutil.copytree(base, root)
            apply(m, root)
            result = run_tests(root, m.tests, extra, args.timeout, threads)
            shutil.rmtree(root, ignore_errors=True)
            return m, result

        results = []
        with ThreadPoolExecutor(args.jobs) as pool:
            for m, (failed, passed, line) in pool.map(trial, enumerate(mutants)):
                print(f"  {m.bug} [{m.site}]: {failed} failing ({line})", flush=True)
                results.append((m, failed))
    survived = False
    print(f"\n{'GPU' if args.gpu else 'CPU'} planted bugs ({time.time() - t0:.0f} s):")
    for bug in dict.fromkeys(m.bug for m, _ in results):
        sites = [(m, n) for m, n in results if m.bug == bug]
        total = sum(n for _, n in sites)
        missed = [m.site for m, n in sites if n == 0]
        survived |= bool(missed)
        detail = ", ".join(f"{m.site}: {n}" for m, n in sites)
        print(f"{bug}: caught by {total} tests ({detail})" + (f"  SURVIVED at {missed}" if missed else ""))
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
