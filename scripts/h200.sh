#!/usr/bin/env bash
# The GPU checks and benchmarks of the mono path, one part per device call (each fits the 10-minute
# limit of a call): `bash scripts/h200.sh PART` with $OUT set (the device tool sets it).
#   tests         the mono kernels' tests on the GPU, the runner's first (pytest, MONODECODE_TEST_DEVICE=cuda;
#                 -m "": the `slow` tests too, which the default CPU run leaves to their cheaper twins)
#   tests-model   the rest of the GPU tests: attention, mHC, router, bench, model, speculation, engine
#                 (one call held both until the tests outgrew the 10 minutes of a call); for either,
#                 SELECT picks tests by pytest -k (e.g. SELECT='fragment or warm'), FILES the test files
#   tests-all     both lists above at once (the `slow` tests too), as SHARDS (default 8) parallel pytest processes
#                 (tools/sharded_pytest.py: the tests' time is mostly compiling, and this machine has
#                 16 cores); $OUT/shard_i.txt each; IDS names a file of test ids (one a line) to
#                 run instead
#   tests-tp      the tensor-parallel tests on two GPUs (a multi-GPU kind): the sums over the ranks alone and
#                 the kernels over two ranks against one GPU (NCCL, symmetric memory)
#   check         python -m monodecode.bench.mono_check --layers 4 (window, window, CSA, HCA), $SHAPE or the default
#                 shape; SKIP=graph,timeline,error_path (say) runs only the rest. Give it a call of its own: on a
#                 fresh machine 330 s were not enough (torch.compile of the CSA / HCA attention at every width)
#   check-shape   the same on 2 layers with $SHAPE (a LaunchShape spec), before making it the default
#   spec-check    python -m monodecode.bench.spec_check --layers 4: greedy speculation with the draft on the
#                 kernels (the draft's blocks, and the plain path's own tokens cut at random places) against
#                 plain greedy decoding, $TOKENS (default 32) tokens a request at $REQUESTS (default 1,2,4,8), the
#                 blocks of $DRAFTS (default draft,oracle); 1,2,4 with both took 560 s on a fresh H100: give 8 a call
#   bench-layer   monodecode bench layer at 1, 6, 16, 48 rows with the shapes in $SHAPES and the timeline,
#                 over $TP ranks (default 1; one GPU each: a multi-GPU kind); WARM=1 first compiles every kind,
#                 width and shape in parallel processes (as ab's), with $ALONGSIDE beside them
#   ab            bench layer of baseline/ (a `git archive` of main, carried) and of this tree, in the order
#                 base, new, new, base (runs base1, new1, new2, base2 in $OUT/ab_runs.tar.gz; TIMELINE=--timeline adds the timeline
#                 to round 2, when both trees' kernels are compiled), then tools/ab_summary.py: each run's
#                 mono time with the per-op graph as a control, and the trees' fastest runs. KINDS, WIDTHS and
#                 SHAPES as for bench-layer (defaults: window, 6: one width; default); TIMEOUT bounds each run (150);
#                 TREES='base=baseline mid=other new=.' (name=folder, names in lower case) times more trees,
#                 in that order and back; WARM=1 first compiles every tree, kind and width in parallel
#                 processes (one core each), so that the timed runs start with Triton's cache warm, and
#                 runs the command in $ALONGSIDE beside them (e.g. a `tests` part: done before any timing);
#                 a tree whose monodecode/ is the first tree's is refused unless SAME=1
#   compiled      monodecode bench layer with the per-op layer also under torch.compile ($MODE, default
#                 max-autotune-no-cudagraphs: 1.5-2 min of compiling a width), the shapes in $SHAPES
#                 (default: the default shape)
#   bench-decode  monodecode bench decode on 4 layers at the request counts in $REQUESTS (default 1,2,4,8),
#                 $TEMPERATURE (default 0) and $TOP_P (default 1), over $TP ranks (default 1; one GPU each),
#                 the paths in $PATHS (default per-op,stepwise,whole; the per-op graph's row alone took ~250 s
#                 at 1 request on 2026-12-05); HOST_PROFILE=1 adds the host's operations a step (--host-profile)
#   decode-ab     bench decode of each tree in $TREES (as ab's: name=folder, default 'base=baseline new=.') in
#                 the order base, new, new, base, as bench-decode's settings say (PATHS default whole here,
#                 REQUESTS default 1,8; $DECODE_ARGS: more arguments); each run's rows in $OUT/decode-ab.txt
#                 and its printout in $OUT/decode_ab_NAMEROUND.txt; TIMEOUT bounds each run (200)
#   experts       the routed-expert stage alone, as K3 runs it (python -m monodecode.bench.experts), the
#                 launch shapes in $SHAPES (default: the default shape)
#   profile       Nsight Compute's PC sampling of one step of a $KIND layer's (default window) K1, K2 and K3 at $WIDTH rows
#                 (default 1; $SHAPE, default the default shape), summed by stage (tools/stall_profile.py);
#                 $OUT/profile.ncu-rep, profile_source.csv (the SASS with its samples), profile_details.csv
# TIMEOUT (seconds, default 560) bounds a part; KINDS and WIDTHS pick bench-layer's layer kinds and rows
# (TIMELINE= , empty, leaves its per-stage timeline out), CONTEXT its cached tokens a request (512; bench-layer
# and ab).
# Output: $OUT/PART.txt (and the JSON / PNG each command writes), device and versions first.
set -u
part=${1:?usage: bash scripts/h200.sh tests|tests-model|tests-all|tests-tp|check|check-shape|bench-layer|ab|compiled|bench-decode|decode-ab|experts|profile}
out=${OUT:?set OUT to the output folder}
mkdir -p "$out"
export PYTHONPATH=$PWD
{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)"
} > "$out/$part.txt" 2>&1
# warm TREE KINDS WIDTHS SHAPES [--timeline]: compile every (kind, width, shape) of the tree's kernels in processes of
# their own, at most $PARALLEL (default 8) at once (a compile is one CPU core's work; each process holds a
# layer's weights), so that the timed runs after it start with Triton's cache warm; the caller waits.
# These runs' times are thrown away (they share the GPU).
warm() {
  local tree=$1 kind width shape
  for kind in ${2//,/ }; do for width in ${3//,/ }; do while IFS= read -r shape; do
    while (( $(jobs -rp | wc -l) >= ${PARALLEL:-8} )); do sleep 1; done
    (cd "$tree" && PYTHONPATH=$PWD timeout ${WARM_TIMEOUT:-240} python3 -m monodecode.cli bench layer --reps 1 \
      --widths $width --kinds $kind --shapes "$shape" --context "${CONTEXT:-512}" ${5:-} \
      --out /tmp/warm > /dev/null 2>&1) &
  done <<< "${4//;/$'\n'}"; done; done
}
# in_turns NAME=FOLDER...: each entry with its round, in the order first, ..., last, last, ..., first
# (NAME=FOLDER=1 ..., then NAME=FOLDER=2 in reverse): a drift over a call falls on every tree alike
in_turns() {
  local i entries=("$@")
  for ((i=0; i<${#entries[@]}; i++)); do echo "${entries[i]}=1"; done
  for ((i=${#entries[@]}-1; i>=0; i--)); do echo "${entries[i]}=2"; done
}
case $part in
  tests)
    MONODECODE_TEST_DEVICE=cuda timeout ${TIMEOUT:-560} python3 -m pytest -q -p no:cacheprovider -m "" \
      -rfE --tb=short --durations=10 ${SELECT:+-k "$SELECT"} \
      ${FILES:-tests/test_mono_runner.py tests/test_mono_runner_build.py tests/test_mono_sync.py tests/test_mono_experts.py tests/test_mono_gemv.py tests/test_mono_peers.py} \
      >> "$out/$part.txt" 2>&1 ;;
  tests-model)
    MONODECODE_TEST_DEVICE=cuda timeout ${TIMEOUT:-560} python3 -m pytest -q -p no:cacheprovider -m "" \
      -rfE --tb=short --durations=10 ${SELECT:+-k "$SELECT"} \
      ${FILES:-tests/test_mono_attention.py tests/test_mono_hc.py tests/test_mono_router.py tests/test_bench_layer.py \
      tests/test_model.py tests/test_speculative.py tests/test_engine.py} >> "$out/$part.txt" 2>&1 ;;
  tests-all)
    selection=(-- -m "" tests/test_mono_runner.py tests/test_mono_runner_build.py tests/test_mono_sync.py tests/test_mono_experts.py tests/test_mono_gemv.py tests/test_mono_peers.py
      tests/test_mono_attention.py tests/test_mono_hc.py tests/test_mono_router.py tests/test_bench_layer.py
      tests/test_model.py tests/test_speculative.py tests/test_engine.py)
    [ -n "${IDS:-}" ] && selection=(--ids "$IDS" -- -m "")
    MONODECODE_TEST_DEVICE=cuda python3 tools/sharded_pytest.py --shards ${SHARDS:-8} --logs "$out" \
      --timeout ${TIMEOUT:-560} "${selection[@]}" >> "$out/$part.txt" 2>&1 ;;
  tests-tp)
    MONODECODE_TEST_DEVICE=cuda timeout ${TIMEOUT:-560} python3 -m pytest -q -p no:cacheprovider -m "" \
      -rfE --tb=short --durations=10 tests/test_mono_peers.py tests/test_mono_tensor_parallel.py >> "$out/$part.txt" 2>&1 ;;
  check)
    timeout ${TIMEOUT:-560} python3 -m monodecode.bench.mono_check --layers 4 --skip "${SKIP:-}" --shape "${SHAPE:-default}" \
      --out "$out/check.json" >> "$out/$part.txt" 2>&1 ;;
  spec-check)
    timeout ${TIMEOUT:-560} python3 -m monodecode.bench.spec_check --layers 4 --requests "${REQUESTS:-1,2,4,8}" \
      --tokens "${TOKENS:-32}" --drafts "${DRAFTS:-draft,oracle}" --out "$out/spec_check.json" >> "$out/$part.txt" 2>&1 ;;
  check-shape)
    timeout ${TIMEOUT:-560} python3 -m monodecode.bench.mono_check --layers 2 --shape "${SHAPE:?set SHAPE}" --skip timeline \
      --out "$out/check_shape.json" >> "$out/$part.txt" 2>&1 ;;
  bench-layer)
    if [ -n "${WARM:-}" ]; then
      [ -n "${ALONGSIDE:-}" ] && (eval "$ALONGSIDE") &
      warm . "${KINDS:-window,CSA,HCA}" "${WIDTHS:-1,6,16,48}" "${SHAPES:-default}" "${TIMELINE---timeline}"
      wait
      echo "warm: $SECONDS s" >> "$out/$part.txt"
    fi
    timeout ${TIMEOUT:-560} python3 -m monodecode.cli bench layer --widths "${WIDTHS:-1,6,16,48}" \
      --kinds "${KINDS:-window,CSA,HCA}" ${TIMELINE---timeline} --shapes "${SHAPES:-default}" \
      --context "${CONTEXT:-512}" --tensor-parallel-size "${TP:-1}" --out "$out" >> "$out/$part.txt" 2>&1 ;;
  ab)
    trees=(${TREES:-base=baseline new=.})
    kinds=${KINDS:-window} widths=${WIDTHS:-6}
    for entry in "${trees[@]}"; do
      [ -d "${entry#*=}/monodecode" ] || { echo "ab: no ${entry#*=}/monodecode (git archive main monodecode scripts tools pyproject.toml | tar -x -C ${entry#*=})" | tee -a "$out/$part.txt" >&2; exit 2; }
    done
    # a tree whose kernels are the first tree's would time nothing (a branch that was not checked out):
    # refused unless SAME=1 (an A/B of no change, to see the runs' spread)
    first=${trees[0]#*=}
    for entry in "${trees[@]:1}"; do
      if [ -z "${SAME:-}" ] && diff -rq -x __pycache__ "$first/monodecode" "${entry#*=}/monodecode" > /dev/null; then
        echo "ab: ${entry#*=}/monodecode is the same as $first/monodecode (SAME=1 times them anyway)" | tee -a "$out/$part.txt" >&2; exit 2
      fi
    done
    if [ -n "${WARM:-}" ]; then
      [ -n "${ALONGSIDE:-}" ] && (eval "$ALONGSIDE") &
      for entry in "${trees[@]}"; do warm "${entry#*=}" "$kinds" "$widths" "${SHAPES:-default}" "${TIMELINE:-}"; done
      wait
      echo "warm: $SECONDS s" >> "$out/$part.txt"
    fi
    # a folder of this call's runs alone: an earlier call on the same machine left its own there
    rm -rf /tmp/ab_runs
    for entry in $(in_turns "${trees[@]}"); do
      IFS== read -r name tree round <<< "$entry"
      case $round in 2) timeline=${TIMELINE:-} ;; *) timeline= ;; esac
      runs=/tmp/ab_runs; mkdir -p "$runs/$name$round"
      (cd $tree && PYTHONPATH=$PWD timeout ${TIMEOUT:-150} python3 -m monodecode.cli bench layer --widths "$widths" \
        --kinds "$kinds" --shapes "${SHAPES:-default}" --context "${CONTEXT:-512}" $timeline --out "$runs/$name$round" > "$runs/$name$round/bench-layer.txt" 2>&1)
      echo "$name$round: exit $? ($SECONDS s)" >> "$out/$part.txt"
      rm -f "$runs/$name$round/bench_layer.png"
      # a call brings back at most 8 files: the runs travel as one archive, summarised after each run
      tar -czf "$out/ab_runs.tar.gz" -C "$runs" .
      python3 tools/ab_summary.py "$runs" > "$out/ab_summary.txt" 2>&1
    done
    cat "$out/ab_summary.txt" >> "$out/$part.txt" ;;
  decode-ab)
    for entry in $(in_turns ${TREES:-base=baseline new=.}); do
      IFS== read -r name tree round <<< "$entry"
      (cd "$tree" && PYTHONPATH=$PWD timeout ${TIMEOUT:-200} python3 -m monodecode.cli bench decode --layers 4 \
        --requests "${REQUESTS:-1,8}" --temperature "${TEMPERATURE:-0}" --top-p "${TOP_P:-1}" \
        --paths "${PATHS:-whole}" ${HOST_PROFILE:+--host-profile} ${DECODE_ARGS:-} --out "/tmp/decode_ab/$name$round" \
        > "$out/decode_ab_$name$round.txt" 2>&1)
      echo "$name$round: exit $? ($SECONDS s)" >> "$out/$part.txt"
      grep -E "^(mono|per-op)" "$out/decode_ab_$name$round.txt" | sed "s/^/$name$round: /" >> "$out/$part.txt"
    done ;;
  compiled)
    timeout ${TIMEOUT:-560} python3 -m monodecode.cli bench layer --widths "${WIDTHS:-1,6,16,48}" \
      --kinds "${KINDS:-window,CSA,HCA}" --shapes "${SHAPES:-default}" --compile "${MODE:-max-autotune-no-cudagraphs}" \
      --out "$out" >> "$out/$part.txt" 2>&1 ;;
  bench-decode)
    timeout ${TIMEOUT:-560} python3 -m monodecode.cli bench decode --layers 4 --requests "${REQUESTS:-1,2,4,8}" \
      --temperature "${TEMPERATURE:-0}" --top-p "${TOP_P:-1}" --tensor-parallel-size "${TP:-1}" \
      --paths "${PATHS:-per-op,stepwise,whole}" ${HOST_PROFILE:+--host-profile} --out "$out" \
      >> "$out/$part.txt" 2>&1 ;;
  experts)
    timeout ${TIMEOUT:-560} python3 -m monodecode.bench.experts --shapes "${SHAPES:-default}" --out "$out" \
      >> "$out/$part.txt" 2>&1 ;;
  profile)
    # in the step's NVTX range (not the build's launches), the second step's three launches (the first
    # step's are skipped: cold caches); L2 and clocks as in a run
    timeout ${TIMEOUT:-560} ncu --nvtx --nvtx-include "profiled/" --kernel-name regex:'^_k[123]$' \
      --launch-skip 3 --launch-count 3 \
      --section SourceCounters --section WarpStateStats --section SpeedOfLight --cache-control none \
      --clock-control none -f -o "$out/profile" python3 tools/stall_profile.py step --kind "${KIND:-window}" \
      --width "${WIDTH:-1}" \
      --shape "${SHAPE:-default}" >> "$out/$part.txt" 2>&1
    ncu --import "$out/profile.ncu-rep" --page source --csv --print-source sass > "$out/profile_source.csv" \
      2>> "$out/$part.txt"
    ncu --import "$out/profile.ncu-rep" --page details --csv > "$out/profile_details.csv" 2>> "$out/$part.txt"
    head -c 1500 "$out/profile_source.csv" >> "$out/$part.txt"; echo >> "$out/$part.txt"  # the CSV's columns
    python3 tools/stall_profile.py summary "$out/profile_source.csv" >> "$out/$part.txt" 2>&1 ;;
  *) echo "unknown part $part" >&2; exit 2 ;;
esac
status=$?
echo "exit $status" >> "$out/$part.txt"
grep -v "it/s\]\|tensor/s\]" "$out/$part.txt" | tail -c 6000
exit $status
