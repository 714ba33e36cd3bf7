#!/usr/bin/env bash
# Build, check and time on the GPU machine in one call, by stage. From the repo root, after
# `source .wheelhouse/b/install.sh`:
#   bash scripts/device_check.sh [tests] [decode] [recurrent] [sanitize] [probe] [mutations] [compare] [seed8] [fla8] [paths] [paths-ab] [decode-splits] [decode-anatomy] [decode-overlap] [steps] [sm100] [bench-OP-GRID] [peers-OP-GRID] ...
# Peers: carry a part of .wheelhouse/peers[_flashqla] per call (scripts/peer_wheels.sh); each call keeps what it
# carried in /tmp and installs a set once all its parts are there.
# Logs go to $OUT/logs_<stages>.tgz (one file: a call brings back at most 8), the seed8 / fla8 JSON to ./device_out (kept
# on the machine between calls) and a copy into $OUT. Every stage runs under a hard limit (SIGINT first, so a
# sweep writes the cells it measured), so a hung kernel cannot eat the session.
#   tests      every GPU test (CI runs the rest); --require-gpu: a GPU test (or FLA) that cannot run fails;
#              tests-1 / tests-2 its two halves (chunked-forward and decode files / the rest), one call each
#   sanitize   compute-sanitizer memcheck, racecheck, synccheck over scripts/sanitize_cases.py (every path, small), one
#              run per tool and op ($SANITIZE_TOOLS, $SANITIZE_OPS: subsets of "memcheck racecheck synccheck", "gdn kda decode")
#   probe      racecheck over scripts/racecheck_probe.py: which synchronization patterns the tool models
#   decode     the decode-attention GPU tests alone (tests/test_decode.py)
#   recurrent  the decode-step GPU tests alone (tests/test_recurrent.py)
#   mutations  planted kernel bugs, each caught by the GPU tests (scripts/mutations.py --gpu; $MUTATION_ONLY: --only)
#   compare    outputs of every path bitwise against the tree in $BASELINE (default .baseline: an older export)
#   decode-ab  the decode steps (GDN, KDA) of $BASELINE (and the exported trees in $VARIANTS) and this tree on
#              $DECODE_CELLS of the full grid, alternated twice, FLA beside (its times: the rounds' drift);
#              $DECODE_OPS="decode": decode attention on $ATTN_CELLS instead, torch SDPA beside
#   seed8      eight seed cells per op ($SEED_OPS: gdn,kda; $SEED_FORMS: plain,gate,l2norm), $BASELINE and this tree
#              alternated, then the comparison
#              (scripts/seed_cells.py; a fresh ./device_out/seed8_*.json per machine)
#   fla8       the same cells with FLA (then seed8's comparison again, FLA beside; at least 300 s: Triton autotunes)
#   paths      scripts/time_paths.py paths
#   paths-ab   the same for $BASELINE and this tree, alternated twice ($PATH_CELLS: "B,H,T;..."; $TIME_OPS: gdn,kda)
#   decode-splits  scripts/time_paths.py decode: the split-KV decode's default plan, each split count forced,
#              stream-K and torch SDPA ($DECODE_SPLIT_CELLS)
#   steps      scripts/time_paths.py steps: the GDN decode step on tensor cores and token by token ($STEP_CELLS)
#   sm100      the first run on an SM100 machine: sm_100a (or sm_103a) builds, every GPU test, the sanitizers, the decode, GDN and
#              KDA sweeps; on another GPU a dry run (builds, test collection, the sweeps' grids, the sanitizer's presence)
#   profile-CASE  one kernel under ncu's source counters, warp stalls per line of its Python (scripts/profile_lines.py:
#              gdn-fused, kda-fused, gdn-two-phase, gdn-step, kda-step, decode, decode-small, decode-short)
#   decode-anatomy  ours and torch SDPA kernel by kernel under ncu (scripts/decode_anatomy.py kernels; grid, GPU
#              time, DRAM bytes per kernel of one call; $ANATOMY_CELLS)
#   decode-overlap  the same cells replayed from CUDA graphs under nsys (or torch's profiler where nsys is missing):
#              each kernel's time and the gaps between consecutive kernels (does the next call start before this
#              one ends?)
#   peers-OP-GRID  ours against FLA, FlashInfer and FlashQLA (CUDA graphs; FlashQLA in its own process when
#              scripts/peer_install.sh flashqla ran): benchmarks/results' {op}_peers_<device>_<date>.json
set -uo pipefail
dest=${OUT:-device_out}
out=$dest/logs
keep=$PWD/device_out
mkdir -p "$out" "$keep"
export PYTHONUNBUFFERED=1
baseline=${BASELINE:-.baseline}
stages=${*:-tests}
status=0
t=${STAGE_TIMEOUT:-300}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader | tee "$out/gpu.txt"
# The peers' wheel parts (scripts/peer_wheels.sh): a carried part is kept in /tmp for later calls on this machine,
# and once every part of a set is there it is installed (once) and put on PYTHONPATH for this call
for set in flashinfer flashqla; do
  src=.wheelhouse/peers$([ $set = flashqla ] && echo _flashqla); parts=/tmp/peer_parts_$set
  for p in "$src"/p*/; do [ -d "$p" ] && mkdir -p "$parts" && cp -r "$p". "$parts"/; done
  [ -f "$parts/manifest" ] && [ "$(ls "$parts" | grep -c '^part')" = "$(cut -d' ' -f3 "$parts/manifest")" ] || continue
  if [ $set = flashinfer ]; then
    source scripts/peer_install.sh flashinfer && echo "peers: flashinfer installed"
  elif [ ! -f /tmp/site_flashqla/.complete ]; then
    # its own process only (its apache-tvm-ffi shadows ours): installed here, imported by the peers stage
    (source scripts/peer_install.sh flashqla) && echo "peers: flashqla installed"
  fi
done
# Compiled kernels on disk (cute_kernels/runtime/aot.py) in ./.aot: every process of this call, and of later calls
# while the machine stays warm, compiles each kernel once (a carried .aot filled on the CPU machine counts too).
# CUTE_KERNELS_DUMP_DIR stays unset here: a process with a dump directory compiles every kernel afresh.
export CUTE_KERNELS_AOT_DIR=$PWD/.aot CUTE_KERNELS_AOT_WRITE=1
mkdir -p .aot
echo "AOT kernels in .aot: $(ls .aot | wc -l)"
sanitizer=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
run() {   # run LOG LIMIT CMD...: one command under its limit, its log in $out, its status into $status
  local log=$1 lim=$2; shift 2
  timeout -s INT -k 20 "$lim" "$@" > "$out/$log" 2>&1
  local rc=$?
  grep -v "Warn" "$out/$log" | tail -${TAIL:-25}
  echo "--- $log: exit $rc"
  status=$((status | (rc != 0)))
}
for stage in $stages; do
  echo "=== $stage $(date -u +%H:%M:%S)"
  case "$stage" in
    tests|tests-1|tests-2)   # tests-1 / tests-2: the two halves, one call each (the whole takes about 560 s)
      half1="tests/test_gdn_sm90.py tests/test_decode.py tests/test_aot.py tests/test_torch_ops.py"
      sel=$([ "$stage" = tests-1 ] && echo "$half1" || echo tests)
      skip=$([ "$stage" = tests-2 ] && for f in $half1; do printf -- "--ignore=%s " "$f"; done)
      # a test stuck past 150 s prints every thread's stack into the log (then the stage limit ends it)
      run "$stage.log" $t python3 -m pytest $sel $skip -q -p no:cacheprovider --require-gpu -m "gpu and not compile" \
        --tb=short -o faulthandler_timeout=150 --durations=10 ;;
    decode)
      run decode.log $t python3 -m pytest tests/test_decode.py -q -p no:cacheprovider --require-gpu -m gpu --tb=short ;;
    recurrent)
      run recurrent.log $t python3 -m pytest tests/test_recurrent.py -q -p no:cacheprovider --require-gpu \
        -m "gpu and not compile" --tb=short ;;
    sanitize)
      for tool in ${SANITIZE_TOOLS:-memcheck racecheck synccheck}; do
        for op in ${SANITIZE_OPS:-gdn kda decode}; do
          TAIL=20 run "sanitize_${tool}_$op.log" $t "$sanitizer" --tool $tool --error-exitcode 99 \
            --target-processes all python3 scripts/sanitize_cases.py $op
        done
      done ;;
    probe)
      TAIL=40 run racecheck_probe.log $t "$sanitizer" --tool racecheck --error-exitcode 99 --target-processes all \
        python3 scripts/racecheck_probe.py ;;
    mutations)
      TAIL=30 run mutations.log $t python3 scripts/mutations.py --gpu --jobs ${MUTATION_JOBS:-4} --pytest-args=--require-gpu \
        ${MUTATION_ONLY:+--only $MUTATION_ONLY} ;;
    compare)
      PYTHONPATH=$PWD/$baseline:$PYTHONPATH CUTE_KERNELS_AOT_DIR=$PWD/.aot_baseline TAIL=3 \
        run compare_save.log $t python3 scripts/compare_builds.py save /tmp/baseline_outputs.pt
      TAIL=40 run compare_check.log $t python3 scripts/compare_builds.py check /tmp/baseline_outputs.pt ;;
    decode-ab)   # the decode steps of $BASELINE and this tree on $DECODE_CELLS, alternated twice (FLA beside)
      for op in ${DECODE_OPS:-gdn_decode kda_decode}; do
        # decode attention: its own cells ($ATTN_CELLS: B = 1, 2, 4 at 512-16K, Hkv 8 and 4, paged, ragged), SDPA beside
        peer=fla; cells=${DECODE_CELLS:-68:72,8,10,11,56,58,59}
        [ "$op" = decode ] && peer=sdpa && cells=${ATTN_CELLS:-0,1,2,3,6,8,14,42,44,45,168,180}
        for round in 1 2; do
          # -P: no working folder on sys.path, so the baseline's cute_kernels comes first (benchmarks from here);
          # $VARIANTS: more exported trees, each timed the same way (AOT entries are keyed by their sources)
          for tree in $baseline ${VARIANTS:-}; do
            tag=$([ "$tree" = "$baseline" ] && echo old || basename "$tree" | tr -d .)
            PYTHONPATH=$PWD/$tree:$PYTHONPATH CUTE_KERNELS_AOT_DIR=$PWD/.aot_baseline TAIL=12 \
              run "${op}_${tag}_$round.log" $t python3 -P -m benchmarks.sweep --op $op --grid full \
              --cells "$cells" --peers $peer --out /tmp/decode_$tag
          done
          TAIL=12 run "${op}_new_$round.log" $t python3 -m benchmarks.sweep --op $op --grid full \
            --cells "$cells" --peers $peer --out /tmp/decode_new
        done
      done ;;
    seed8)
      for round in 1 2; do
        PYTHONPATH=$PWD/$baseline:$PYTHONPATH CUTE_KERNELS_AOT_DIR=$PWD/.aot_baseline TAIL=0 \
          run seed8_old_$round.log $t python3 scripts/seed_cells.py time ours "$keep/seed8_old.json" ${SEED_OPS:-gdn,kda} \
          ${SEED_FORMS:-plain}
        TAIL=0 run seed8_new_$round.log $t python3 scripts/seed_cells.py time ours "$keep/seed8_new.json" ${SEED_OPS:-gdn,kda} \
          ${SEED_FORMS:-plain}
      done
      TAIL=30 run seed8.log 60 python3 scripts/seed_cells.py compare "$keep/seed8_new.json" "$keep/seed8_old.json" ;;
    fla8)
      TAIL=0 run fla8.log $((t > 300 ? t : 300)) python3 scripts/seed_cells.py time fla "$keep/seed8_fla.json"
      TAIL=30 run seed8_fla_compare.log 60 python3 scripts/seed_cells.py compare "$keep/seed8_new.json" \
        "$keep/seed8_old.json" "$keep/seed8_fla.json" ;;
    paths)
      run paths.log $t python3 scripts/time_paths.py paths ;;
    paths-ab)   # time_paths paths of $BASELINE and this tree on $PATH_CELLS ($TIME_OPS), alternated twice
      for round in 1 2; do
        PYTHONPATH=$PWD/$baseline:$PYTHONPATH CUTE_KERNELS_AOT_DIR=$PWD/.aot_baseline TAIL=12 \
          run paths_old_$round.log $t python3 scripts/time_paths.py paths ${PATH_CELLS:-}
        TAIL=12 run paths_new_$round.log $t python3 scripts/time_paths.py paths ${PATH_CELLS:-}
      done ;;
    decode-splits)   # split-KV decode per split count on short-KV cells ($DECODE_SPLIT_CELLS)
      TAIL=12 run decode_splits.log $t python3 scripts/time_paths.py decode ${DECODE_SPLIT_CELLS:-} ;;
    steps)   # the GDN decode step on tensor cores and token by token ($STEP_CELLS)
      TAIL=12 run steps.log $t python3 scripts/time_paths.py steps ${STEP_CELLS:-} ;;
    peers-*)   # peers-OP-GRID: ours, FLA and FlashInfer in one process; FlashQLA (if installed) in its own; merged
      spec=${stage#peers-}; op=${spec%%-*}; grid=${spec#*-}
      rm -rf "$dest/peers_main" "$dest/peers_qla"
      # --graph: the chunked ops' sweep times CUDA-graph replay on request; the decode sweeps always do
      graph=$(case "$op" in gdn|kda) echo --graph ;; esac)
      TAIL=40 run "peers_${op}_$grid.log" $t python3 -m benchmarks.sweep --op "$op" --grid "$grid" $graph \
        --peers fla,flashinfer --out "$dest/peers_main" ${BENCH_ARGS:-}
      if [ -f /tmp/site_flashqla/.complete ] && [ "$op" = gdn ]; then   # FlashQLA: the chunked GDN only
        PYTHONPATH=/tmp/site_flashqla${PYTHONPATH:+:$PYTHONPATH} TAIL=10 run "peers_${op}_${grid}_flashqla.log" $t \
          python3 -m benchmarks.sweep --op "$op" --grid "$grid" --graph --no-ours --peers flashqla \
          --out "$dest/peers_qla" ${BENCH_ARGS:-}
        main=$(ls "$dest"/peers_main/*.json | head -1); qla=$(ls "$dest"/peers_qla/*.json 2>/dev/null | head -1)
        [ -n "$qla" ] && TAIL=60 run "peers_${op}_${grid}_merge.log" 120 python3 -m benchmarks.combine --merge-peers \
          "$dest/$(basename "$main")" "$main" "$qla"
      else
        cp "$dest"/peers_main/* "$dest"/
      fi
      rm -rf "$dest/peers_main" "$dest/peers_qla" ;;
    sm100)   # the first run on an SM100 machine; on any other GPU a dry run that checks its own steps
      cap=$(python3 -c "import torch; print('%d%d' % torch.cuda.get_device_capability())" 2>/dev/null)
      dry=$([ "${cap:0:2}" = "10" ] && echo 0 || echo 1)
      arch=$([ "$cap" = "103" ] && echo sm_103a || echo sm_100a)
      echo "sm100: compute capability ${cap:-none}, arch $arch, dry run: $dry"
      TAIL=30 run sm100_compile.log $t python3 -m cute_kernels compile --arch $arch --out /tmp/ck100
      if [ "$dry" = 1 ]; then
        # the steps that need SM100, checked without running: the tests collect, the sweeps parse their grids
        TAIL=5 run sm100_collect.log $t python3 -m pytest tests -q -p no:cacheprovider --collect-only -m gpu
        TAIL=5 run sm100_sweeps.log 120 python3 -c "from benchmarks import recurrent_decode as r, decode as d; \
print(len(r.grid('full')), 'decode-step cells;', len(d.grid('full')), 'decode cells')"
        [ -n "$sanitizer" ] && echo "sanitizer: $sanitizer" || { echo "sanitizer: missing"; status=1; }
      else
        # (no --require-gpu: the SM90-only tests skip here; every test of an op that runs on SM100 must pass)
        run sm100_tests.log $t python3 -m pytest tests -q -p no:cacheprovider -m "gpu and not compile" --tb=short
        TAIL=20 run sm100_memcheck.log $t "$sanitizer" --tool memcheck --error-exitcode 99 --target-processes all \
          python3 -m pytest tests/test_recurrent.py -q -p no:cacheprovider -m gpu -k "kernel_matches_spec and weak"
        # the decode kernel's fixup counts across CTAs; both kernels' pipelines hand TMEM / smem between warps
        for tool in memcheck racecheck synccheck; do
          for ops in decode gdn-fused kda-fused; do
            TAIL=20 run "sm100_${tool}_${ops}.log" $t "$sanitizer" --tool $tool --error-exitcode 99 \
              --target-processes all python3 scripts/sanitize_cases.py $ops
          done
        done
        for op in gdn_decode kda_decode; do
          TAIL=40 run "sm100_bench_$op.log" $t python3 -m benchmarks.sweep --op $op --grid full --out "$dest"
        done
        TAIL=40 run sm100_bench_gdn.log $t python3 -m benchmarks.sweep --op gdn --grid seed --graph --out "$dest"
        TAIL=40 run sm100_bench_kda.log $t python3 -m benchmarks.sweep --op kda --grid seed --graph --out "$dest"
        TAIL=40 run sm100_bench_decode.log $t python3 -m benchmarks.sweep --op decode --grid quick --out "$dest"
      fi ;;
    profile-*)   # one kernel's warp-stall samples per source line (scripts/profile_lines.py; ncu, line info)
      case=${stage#profile-}
      regex=$(python3 -c "import sys; sys.path.insert(0, 'scripts'); import profile_lines as p; print(p.CASES['$case'][0])")
      # (built with line info: not from .aot, whose builds have none)
      lineinfo="env -u CUTE_KERNELS_AOT_DIR -u CUTE_KERNELS_AOT_WRITE CUTE_DSL_LINEINFO=1"
      $lineinfo python3 scripts/profile_lines.py run "$case" > "$out/profile_${case}_warm.log" 2>&1
      TAIL=5 run "profile_$case.log" $t $lineinfo ncu --clock-control none --section SourceCounters \
        --section WarpStateStats --section SpeedOfLight --import-source yes -k "$regex" -c 1 -f -o "/tmp/prof_$case" \
        python3 scripts/profile_lines.py run "$case"
      ncu --import "/tmp/prof_$case.ncu-rep" --page source --csv --print-source cuda,sass \
        > "$out/profile_${case}_source.csv" 2>&1
      TAIL=60 run "profile_${case}_lines.log" 120 python3 scripts/profile_lines.py report "$out/profile_${case}_source.csv"
      TAIL=60 run "profile_${case}_details.log" 120 ncu --import "/tmp/prof_$case.ncu-rep" --page details ;;
    decode-anatomy)
      TAIL=0 run decode_anatomy.log $t ncu --nvtx --profile-from-start off --cache-control all --clock-control none \
        --metrics gpu__time_duration.sum,launch__grid_size,launch__block_size,launch__registers_per_thread,dram__bytes_read.sum,launch__shared_mem_per_block \
        python3 scripts/decode_anatomy.py kernels ${ANATOMY_CELLS:-}
      grep -E "^  [^ ]|<0,|gpu__time|grid_size|dram__bytes" "$out/decode_anatomy.log" | cut -c1-160 | head -120 ;;
    decode-overlap)
      nsys=$(command -v nsys || ls /usr/local/cuda*/bin/nsys /opt/nvidia/nsight-systems/*/bin/nsys 2>/dev/null | head -1)
      if [ -z "$nsys" ]; then   # no Nsight Systems here: torch's profiler records the graphs' kernels instead
        echo "decode-overlap: nsys missing, torch.profiler instead"
        TAIL=80 run decode_overlap.log $t python3 scripts/decode_anatomy.py profile ${ANATOMY_CELLS:-}
        continue
      fi
      rm -f /tmp/decode_overlap.*
      TAIL=5 run decode_overlap_trace.log $t "$nsys" profile --trace cuda,nvtx --cuda-graph-trace node \
        -o /tmp/decode_overlap python3 scripts/decode_anatomy.py replay ${ANATOMY_CELLS:-}
      "$nsys" export --type sqlite -o /tmp/decode_overlap.sqlite /tmp/decode_overlap.nsys-rep > /dev/null 2>&1
      TAIL=80 run decode_overlap.log 120 python3 scripts/decode_anatomy.py overlap /tmp/decode_overlap.sqlite ;;
    bench-*)
      spec=${stage#bench-}; op=${spec%%-*}; grid=${spec#*-}
      TAIL=40 run "bench_${op}_${grid}.log" $t python3 -m benchmarks.sweep --op "$op" --grid "$grid" --out "$dest" ${BENCH_ARGS:-} ;;
    *) echo "unknown stage $stage"; status=1 ;;
  esac
done
[ "$dest" = "$keep" ] || cp "$keep"/*.json "$dest"/ 2>/dev/null
tar czf "$dest/logs_${stages// /_}.tgz" -C "$dest" logs && rm -rf "$out"
echo "=== done, status $status"
exit $status
