#!/usr/bin/env bash
# Build, check and time on the GPU machine in one call (see README "Running on the H200").
# Usage (from the repo root, after `source .wheelhouse/b/install.sh`):
#   bash scripts/device_check.sh [tests] [gpu-tests] [gdn-tests] [seg-tests] [merge-tests] [gdn-smoke] [gdn-profile] [kda-profile]
#                                [host] [merge-time] [two-phase] [two-phase-tests] [two-phase-quick] [prep-time] [state-time] [state-profile] [pair] [pair-auto] [lookback] [one-pass] [kda-tests] [pending-tests] [pending-time] [regs] [regs-profile] [overlap] [bench-OP-GRID] ...
#   e.g. BENCH_ARGS=--graph bash scripts/device_check.sh gdn-smoke gdn-tests bench-gdn-large
# Logs and JSON go to $OUT (or ./device_out), so they come back with the call.
set -uo pipefail
out=${OUT:-device_out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 CUTE_KERNELS_DUMP_DIR=${CUTE_KERNELS_DUMP_DIR:-/tmp/ck_dump}
stages=${*:-tests}
status=0
# A hung kernel must not eat the session's device time: every stage runs under a hard limit (SIGINT first, so a
# sweep writes the cells it measured; SIGKILL 20 s later).
t=${STAGE_TIMEOUT:-300}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,utilization.gpu --format=csv,noheader | tee "$out/gpu.txt"
# CK_AOT=1: compiled kernels on disk (cute_kernels/runtime/aot.py) in ./.aot, so every process of this call -- and
# of the next calls while the machine stays warm (ignored outputs are kept) -- compiles each kernel once. (.aot
# could also be filled on the CPU machine with `CUTE_KERNELS_AOT_DIR=.aot CUTE_KERNELS_AOT_WRITE=1 python -m
# cute_kernels compile --arch sm_90a`, but the carried tree is limited to 64 MiB and .wheelhouse/b takes 53.) Used
# only after its GPU test (a loaded kernel bitwise equal to the JIT one) passes here.
if [ "${CK_AOT:-0}" = 1 ]; then
  if timeout -s INT -k 10 120 python3 -m pytest tests/test_aot.py -q -p no:cacheprovider -k equals_jit 2>&1 | tail -2 | tee "$out/aot_check.log" | grep -q "1 passed"; then
    export CUTE_KERNELS_AOT_DIR=$PWD/.aot CUTE_KERNELS_AOT_WRITE=1
    mkdir -p .aot
    echo "AOT kernels: $(ls .aot | wc -l) in .aot"
  else
    echo "AOT check failed: compiling every kernel"
  fi
fi
for stage in $stages; do
  echo "=== $stage $(date -u +%H:%M:%S)"
  case "$stage" in
    tests)   # the whole suite; --require-gpu: a GPU test (or a peer such as FLA) that cannot run fails
      timeout -s INT -k 20 $t python3 -m pytest tests -q -p no:cacheprovider --require-gpu -m "not compile" -k "not test_compile" 2>&1 | tee "$out/tests.log" | tail -25
      status=$((status | ${PIPESTATUS[0]})) ;;
    mutations)   # planted bugs in the kernels, each caught by the GPU tests (scripts/mutations.py --gpu)
      timeout -s INT -k 20 $t python3 scripts/mutations.py --gpu --jobs ${MUTATION_JOBS:-4} --pytest-args=--require-gpu 2>&1 | tee "$out/mutations.log" | tail -30
      status=$((status | ${PIPESTATUS[0]})) ;;
    gpu-tests)
      timeout -s INT -k 20 $t python3 -m pytest tests -q -p no:cacheprovider -m "not compile" -k "gpu or merge or probe" 2>&1 | tee "$out/gpu_tests.log" | tail -25
      status=$((status | ${PIPESTATUS[0]})) ;;
    gdn-tests)
      timeout -s INT -k 20 $t python3 -m pytest tests/test_gdn_sm90.py tests/test_segmented.py -q -p no:cacheprovider 2>&1 | tee "$out/gdn_tests.log" | tail -25
      status=$((status | ${PIPESTATUS[0]})) ;;
    seg-tests)
      timeout -s INT -k 20 $t python3 -m pytest tests/test_segmented.py -q -p no:cacheprovider 2>&1 | tee "$out/seg_tests.log" | tail -5
      status=$((status | ${PIPESTATUS[0]})) ;;
    merge-tests)
      timeout -s INT -k 20 $t python3 -m pytest tests/test_merge.py -q -p no:cacheprovider 2>&1 | tee "$out/merge_tests.log" | tail -5
      status=$((status | ${PIPESTATUS[0]})) ;;
    gdn-smoke)
      timeout -s INT -k 20 $t python3 scripts/gdn_smoke.py ${SMOKE_ARGS:-} 2>&1 | tee "$out/gdn_smoke.log" | grep -v Warn | tail -25
      status=$((status | ${PIPESTATUS[0]})) ;;
    gdn-profile|kda-profile)
      timeout -s INT -k 20 $t python3 scripts/gdn_profile.py ${stage%-profile} 2>&1 | tee "$out/$stage.log" | grep -v Warn
      status=$((status | ${PIPESTATUS[0]})) ;;
    host)
      timeout -s INT -k 20 $t python3 scripts/host_overhead.py 2>&1 | tee "$out/host.log" | grep -v Warn
      status=$((status | ${PIPESTATUS[0]})) ;;
    two-phase)
      timeout -s INT -k 20 $t python3 -m pytest tests/test_two_phase.py -q -p no:cacheprovider 2>&1 | tee "$out/two_phase_tests.log" | tail -5
      status=$((status | ${PIPESTATUS[0]}))
      timeout -s INT -k 20 $t python3 scripts/time_two_phase.py 2>&1 | tee "$out/two_phase_time.log" | grep -v Warn
      status=$((status | ${PIPESTATUS[0]})) ;;
    overlap)   # the overlapped two-phase path: its GPU tests (reference, determinism, flags back at 0), then its time
      if [ "${SKIP_TESTS:-0}" != 1 ]; then
        timeout -s INT -k 10 ${OVERLAP_TEST_S:-240} python3 -m pytest tests/test_two_phase.py -q --tb=short -p no:cacheprovider -k "${OVERLAP_TEST_K:-overlap}" 2>&1 | tee "$out/overlap_tests.log" | tail -8
        status=$((status | ${PIPESTATUS[0]}))
      fi
      timeout -s INT -k 20 $t python3 scripts/time_two_phase.py overlap 2>&1 | tee "$out/overlap_time.log" | grep -v Warn
      status=$((status | ${PIPESTATUS[0]})) ;;
    regs-profile)   # the regs merge's cycles per link by phase (profile build) next to its plain time
      timeout -s INT -k 20 $t python3 scripts/time_merges.py profile 2>&1 | tee "$out/regs_profile.log" | grep -v Warn
      status=$((status | ${PIPESTATUS[0]})) ;;
    regs)   # the `regs` affine merge: its tests, the merges' times, the op's two-phase tests with it forced, the op
      timeout -s INT -k 20 $t python3 -m pytest tests/test_merge.py -q --tb=short -p no:cacheprovider -k "regs or prefetch" 2>&1 | tee "$out/regs_merge_tests.log" | tail -6
      status=$((status | ${PIPESTATUS[0]}))
      MERGE_IMPLS=prefetch,regs,tc timeout -s INT -k 20 $t python3 scripts/time_merges.py 2>&1 | tee "$out/regs_merge_time.log" | grep -v Warn
      status=$((status | ${PIPESTATUS[0]}))
      CUTE_KERNELS_AFFINE_MERGE=regs timeout -s INT -k 20 $t python3 -m pytest tests/test_two_phase.py tests/test_gdn_sm90.py -q --tb=short -p no:cacheprovider -k "(two_phase_matches_reference and rs- and (True-3 or True-32 or False-8)) or (two_phase and varlen)" 2>&1 | tee "$out/regs_op_tests.log" | tail -6
      status=$((status | ${PIPESTATUS[0]}))
      timeout -s INT -k 20 $t python3 scripts/time_two_phase.py merge 2>&1 | tee "$out/regs_op_time.log" | grep -v Warn
      status=$((status | ${PIPESTATUS[0]})) ;;
    two-phase-tests)
      timeout -s INT -k 20 $t python3 -m pytest tests/test_two_phase.py -q -p no:cacheprovider 2>&1 | tee "$out/two_phase_tests.log" | tail -5
      status=$((status | ${PIPESTATUS[0]}))
      timeout -s INT -k 20 $t python3 -m pytest tests/test_gdn_sm90.py -q -p no:cacheprovider -k two_phase 2>&1 | tee "$out/gdn_two_phase_tests.log" | tail -5
      status=$((status | ${PIPESTATUS[0]})) ;;
    two-phase-quick)   # (QUICK_STATE_S=0 skips the state timing) the two-phase tests (slim prep, rs state pass), the op's two-phase path on varlen, timings
      timeout -s INT -k 10 ${QUICK_TEST_S:-80} python3 -m pytest tests/test_two_phase.py -q --tb=line -p no:cacheprovider 2>&1 | tee "$out/two_phase_tests.log" | tail -6
      status=$((status | ${PIPESTATUS[0]}))
      timeout -s INT -k 10 ${QUICK_OP_S:-40} python3 -m pytest tests/test_gdn_sm90.py -q --tb=line -p no:cacheprovider -k "two_phase and varlen" 2>&1 | tee "$out/gdn_two_phase_varlen.log" | tail -3
      status=$((status | ${PIPESTATUS[0]}))
      [ "${QUICK_STATE_S:-45}" = 0 ] || timeout -s INT -k 10 ${QUICK_STATE_S:-45} python3 scripts/time_two_phase.py state 2>&1 | tee "$out/state_time.log" | grep -v Warn
      timeout -s INT -k 10 ${QUICK_HOST_S:-150} python3 scripts/host_overhead.py paths 2>&1 | tee "$out/host_paths.log" | grep -v Warn ;;
    state-time)   # the state pass alone: smem / rs chain and ring depth (STATE_VARIANTS=smem,rs2,rs3)
      timeout -s INT -k 20 $t python3 scripts/time_two_phase.py state 2>&1 | tee "$out/state_time.log" | grep -v Warn
      status=$((status | ${PIPESTATUS[0]})) ;;
    pair)   # the state pass with both V blocks per CTA (pair): GPU tests, then its time against one block per CTA
      timeout -s INT -k 10 ${PAIR_TEST_S:-150} python3 -m pytest tests/test_two_phase.py -q --tb=line -p no:cacheprovider -k "rs-pair or orchestration" 2>&1 | tee "$out/pair_tests.log" | tail -6
      status=$((status | ${PIPESTATUS[0]}))
      timeout -s INT -k 20 $t python3 scripts/time_two_phase.py pair 2>&1 | tee "$out/pair_time.log" | grep -v Warn
      status=$((status | ${PIPESTATUS[0]})) ;;
    lookback)   # the one-launch segmented state pass (STATE_LOOKBACK): GPU tests (bitwise equal to the split launches, flags back at 0), then its time; a hang (a wait that never ends) is cut by the short limit
      if [ "${SKIP_TESTS:-0}" != 1 ]; then
        timeout -s INT -k 10 ${LOOKBACK_TEST_S:-180} python3 -m pytest tests/test_two_phase.py -q --tb=short -p no:cacheprovider -k "lookback" 2>&1 | tee "$out/lookback_tests.log" | tail -8
        status=$((status | ${PIPESTATUS[0]}))
      fi
      timeout -s INT -k 20 $t python3 scripts/time_two_phase.py lookback 2>&1 | tee "$out/lookback_time.log" | grep -v Warn
      status=$((status | ${PIPESTATUS[0]})) ;;
    one-pass)   # the one-pass segmented state pass (STATE_ONE_PASS, and with STATE_EARLY_CORRECTION): GPU tests (reference, 2x the split path's error, determinism; early bitwise equal to waiting, counts back at 0), then its time beside the split and look-back launches; a spin that never ends is cut by the short limit
      timeout -s INT -k 10 ${ONE_PASS_TEST_S:-180} python3 -m pytest tests/test_two_phase.py -q --tb=short -p no:cacheprovider -k "one_pass_state_pass or early_correction" 2>&1 | tee "$out/one_pass_tests.log" | tail -8
      status=$((status | ${PIPESTATUS[0]}))
      timeout -s INT -k 20 $t python3 scripts/time_two_phase.py one-pass 2>&1 | tee "$out/one_pass_time.log" | grep -v Warn
      status=$((status | ${PIPESTATUS[0]})) ;;
    kda-tests)   # KDA's op tests (tests/test_gdn_sm90.py -k kda: varlen, strong decay, both paths) with the defaults
      timeout -s INT -k 10 ${KDA_TEST_S:-240} python3 -m pytest tests/test_gdn_sm90.py -q --tb=line -p no:cacheprovider -k kda 2>&1 | tee "$out/kda_tests.log" | tail -6
      status=$((status | ${PIPESTATUS[0]})) ;;
    pending-tests)   # every GPU test of the builds written without a GPU (sessions 22-24; all passed on an H100 in sessions 25-26), each group under its own short limit (a hang, or a trap from a bounded spin, costs only its group): KDA's op tests with the fold on by default (varlen, strong decay: 26 passed in session 26), the publishing merge, one-pass + early correction, look-back, pair with the fold's terms, KDA's fold
      for group in "kda:240:tests/test_gdn_sm90.py" "publishing_merge:60:tests/test_merge.py" "one_pass_state_pass or early_correction:200:tests/test_two_phase.py" "lookback:150:tests/test_two_phase.py" "pair_state_pass or (two_phase_matches_reference and rs-pair):150:tests/test_two_phase.py" "kda_prep_fold or (fold_matches_reference and KDA_FOLD):150:tests/test_two_phase.py"; do
        k=${group%%:*}; rest=${group#*:}; lim=${rest%%:*}; file=${rest#*:}
        echo "--- -k \"$k\" (limit ${lim} s)"
        timeout -s INT -k 10 $lim python3 -m pytest $file -q --tb=line -p no:cacheprovider -k "$k" 2>&1 | tee -a "$out/pending_tests.log" | tail -4
        status=$((status | ${PIPESTATUS[0]}))
      done ;;
    pending-time)   # the state-pass builds side by side (split / look-back / one-pass / early) on one cell (ONE_PASS_CELLS adds more; each build compiles first, ~15 s, and FLA autotunes each new shape, ~35 s), then the op beside FLA
      ONE_PASS_CELLS=${ONE_PASS_CELLS:-"1,4,16384"} ONE_PASS_SEGMENTS=${ONE_PASS_SEGMENTS:-"8"} timeout -s INT -k 20 ${PENDING_TIME_S:-540} python3 scripts/time_two_phase.py one-pass 2>&1 | tee "$out/pending_time.log" | grep -v Warn
      status=$((status | ${PIPESTATUS[0]})) ;;
    pair-auto)   # STATE_PAIR "auto" with the fold's terms: GPU tests, then its time on multi-wave cells beside FLA
      if [ "${SKIP_TESTS:-0}" != 1 ]; then
        timeout -s INT -k 10 ${PAIR_TEST_S:-150} python3 -m pytest tests/test_two_phase.py -q --tb=short -p no:cacheprovider -k "pair_state_pass or (two_phase_matches_reference and rs-pair)" 2>&1 | tee "$out/pair_auto_tests.log" | tail -6
        status=$((status | ${PIPESTATUS[0]}))
      fi
      timeout -s INT -k 20 $t python3 scripts/time_two_phase.py pair-auto 2>&1 | tee "$out/pair_auto_time.log" | grep -v Warn
      status=$((status | ${PIPESTATUS[0]})) ;;
    state-profile)   # the state pass's cycles per chunk by phase (clock64 stamps, rs consumer)
      timeout -s INT -k 20 $t python3 scripts/time_two_phase.py chain 2>&1 | tee "$out/state_profile.log" | grep -v Warn
      status=$((status | ${PIPESTATUS[0]})) ;;
    prep-time)
      timeout -s INT -k 20 $t python3 scripts/time_two_phase.py prep 2>&1 | tee "$out/prep_time.log" | grep -v Warn
      status=$((status | ${PIPESTATUS[0]})) ;;
    prep-profile)   # GDN phase 1 (slim): its time and cycles per step (clock64 stamps)
      timeout -s INT -k 20 $t python3 scripts/time_two_phase.py prep-profile 2>&1 | tee "$out/prep_profile.log" | grep -v Warn
      status=$((status | ${PIPESTATUS[0]})) ;;
    merge-time)
      timeout -s INT -k 20 $t python3 scripts/time_merges.py 2>&1 | tee "$out/merge_time.log" | grep -v Warn
      status=$((status | ${PIPESTATUS[0]})) ;;
    bench-*)
      spec=${stage#bench-}; op=${spec%%-*}; grid=${spec#*-}
      timeout -s INT -k 20 $t python3 -m benchmarks.sweep --op "$op" --grid "$grid" --out "$out" ${BENCH_ARGS:-} 2>&1 | tee "$out/bench_${op}_${grid}.log" | tail -40
      status=$((status | ${PIPESTATUS[0]})) ;;
    *) echo "unknown stage $stage"; status=1 ;;
  esac
done
echo "=== done, status $status"
exit $status
