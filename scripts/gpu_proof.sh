#!/usr/bin/env bash
# The GPU proof, on a lent GPU machine, from gpu-bundle/ (built here by scripts/gpu-bundle; the GPU
# machine has no Rust toolchain and no network). Two commands of under 10 minutes each:
#
#   scripts/gpu_proof.sh check   nvidia-smi; every kernel against the CPU's (each format; paged
#                                attention on random page tables; graph replay = eager); the
#                                forward of every dense family against the CPU's, graphs = eager
#                                bit for bit, adapters; compute-sanitizer memcheck and racecheck;
#                                the server's HTTP tests on --device cuda
#   scripts/gpu_proof.sh all     one command for a session with little device time (~8 minutes):
#                                the kernels and forward against the CPU, the device HTTP test,
#                                the speed runs, then memcheck of the kernels, each step bounded
#   scripts/gpu_proof.sh race    one command (~8 minutes): llama.cpp's CUDA build in the background
#                                (carry gpu-llamacpp too) while the kernels, the forward and our
#                                speed runs go, then llama-bench on the same files
#   scripts/gpu_proof.sh llamacpp  (optional, before speed; carry gpu-llamacpp from
#                                scripts/gpu-llamacpp in its own call) llama.cpp's CUDA build of
#                                llama-bench for sm_90 into /tmp (kept while the machine is warm)
#   scripts/gpu_proof.sh profile (~3 minutes) ncu's duration of every kernel of the 1B shape's
#                                eager decode at batch 1, summed by kernel (profile-1b.md)
#   scripts/gpu_proof.sh profile-adapter [lora|oft]  (~2 minutes) ncu's duration of each adapter
#                                kernel in the 1B shape's batch-1 decode through the adapter
#   scripts/gpu_proof.sh layouts (~7 minutes) the product layouts (kernels/src/cuda/products.rs):
#                                the kernels test (every layout bit-equal to the default), the
#                                forward under the candidates, then the 1B shape's speed in each
#                                (pp512, tg64 at batch 1/8/64), one after another
#   scripts/gpu_proof.sh adapters (~5 minutes) the forward test (decode graphs with LoRA, OFT and
#                                the head's LoRA = eager, bit for bit; a publish re-captures
#                                nothing), then the 1B shape's decode through a LoRA and an OFT
#                                adapter, graphs against eager, and what a publish costs
#   scripts/gpu_proof.sh next    (one command, at most ~9 minutes) what was written since the
#                                last lent GPU and what to measure next: the kernels and forward
#                                tests (the forward through the tile4 decode layout too), the 1B
#                                shape's speed in the decode layouts block, tile4 and tile2 (the
#                                default before and after) and with int8 products, memcheck of
#                                the kernels, the device HTTP test, attention split by GQA group
#                                against the chunks kernel (forward, decode at 2048 and 8000
#                                positions), ncu's times of the default's decode step, the
#                                forward through the rows kernel, decode through LoRA with A·x a
#                                warp a value and a block a value
#   scripts/gpu_proof.sh context (at most ~9.5 minutes) the chunks attention kernel (split-K
#                                decode attention): its kernels test and the forward through it,
#                                then the 1B shape's decode after 2048-, 8000- and 8-token prompts
#                                by the rows kernel and by the chunks kernel, and ncu's times of
#                                each at 2048 positions
#   scripts/gpu_proof.sh int8    (at most ~8 minutes) the int8 products' lanes layout: the kernels
#                                test, the int8 forward, the 1B shape with int8 products in each
#                                layout and with f32 ones, decode at 8 and 8000 positions by each
#                                attention kernel, racecheck of the kernels given 200 s
#   scripts/gpu_proof.sh int8-profile (~4 minutes) the int8 forward, ncu's times of each kernel
#                                in the 1B shape's int8 decode, decode at 8000 positions by each
#                                attention kernel
#   scripts/gpu_proof.sh speed   random-weight models of the default model's shape and Llama 3.2
#                                1B's; prefill and decode at batch 1/8/32/64 through graphs and
#                                eagerly; the card's copy bandwidth; llama.cpp's CUDA build of the
#                                same files where gpu-bundle/llama-bench is present
#
# Results go to $OUT (the device tool's folder; ./gpu-proof-out without it): summary.md, which
# docs/gpu.md quotes, and one log per step, packed into logs-<pid>.tar.gz at the end of each
# command. Exit status: the number of failed steps.
set -uo pipefail
cd "$(dirname "$0")/.."
B=gpu-bundle
OUT=${OUT:-gpu-proof-out}
mkdir -p "$OUT"
SUMMARY="$OUT/summary.md"
failed=0
export FLYWHEEL_REQUIRE_GPU=1

# step NAME COMMAND...: run it with its output in $OUT/NAME.log, a line in the summary; a step
# runs at most $STEP_S seconds (default 600; `all` sets it per step, to fit one lent session),
# and never past $DEADLINE seconds from the start (default 575: a call runs at most 600, and the
# logs are packed at the end): a step with under 15 s left is skipped and says so.
DEADLINE=${DEADLINE:-575}
step() {
  local name=$1
  shift
  local t0=$SECONDS
  local bound=${STEP_S:-600}
  local left=$((DEADLINE - SECONDS))
  if [ "$left" -lt 15 ]; then
    echo "- $name: SKIPPED (${left} s left of the command's ${DEADLINE})" | tee -a "$SUMMARY" "$OUT/$name.log"
    failed=$((failed + 1))
    return
  fi
  [ "$left" -lt "$bound" ] && bound=$left
  timeout -k 5 "$bound" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  if [ "$rc" = 0 ]; then
    echo "- $name: ok ($((SECONDS - t0)) s)" | tee -a "$SUMMARY"
  else
    local why="FAILED (exit $rc)"
    [ "$rc" = 124 ] || [ "$rc" = 137 ] && why="TIMED OUT after $bound s"
    echo "- $name: $why ($((SECONDS - t0)) s): see $name.log" | tee -a "$SUMMARY"
    tail -20 "$OUT/$name.log"
    failed=$((failed + 1))
  fi
}

# scripts/gpu-bundle gzips the executables (to fit a call's 64 MiB with gpu-llamacpp beside them).
for z in "$B"/*.gz; do
  [ -f "$z" ] && gunzip -f "$z" && chmod +x "${z%.gz}"
done
[ -x "$B/flywheel" ] || { echo "no $B/flywheel: run scripts/gpu-bundle first and carry $B"; exit 99; }
LLAMA_BENCH=/tmp/llama.cpp/build/bin/llama-bench
echo "# GPU proof (${1:-}, $(date -u +%F))" >>"$SUMMARY"
if ! nvidia-smi >"$OUT/nvidia-smi.log" 2>&1; then
  echo "  no GPU here (nvidia-smi failed): nothing to prove" | tee -a "$SUMMARY"
  exit 98
fi
grep -m1 -E "NVIDIA (H|A|L|B)[0-9]+" "$OUT/nvidia-smi.log" | sed 's/^/  card: /' | tee -a "$SUMMARY"

speed() {
  for shape in smollm2-135m llama-1b; do
    m=/tmp/$shape.gguf
    [ -f "$m" ] || step "model-$shape" "$B/flywheel" random-model --shape "$shape" --out "$m"
    step "bench-$shape" "$B/flywheel" bench --device cuda --model "$m" --prompt-tokens 512 \
      --decode-tokens 64 --batch 1,8,32,64 --runs 3 --kv-cache-dtype f16
    grep -E "^(model|test|pp|tg)" "$OUT/bench-$shape.log" | sed 's/^/    /' >>"$SUMMARY"
    [ -x "$LLAMA_BENCH" ] && llama_bench "$shape"
  done
}

# The 1B shape's speed in each product layout ("decode batch" pairs, the default first), each run
# after the other in this one command (the GPU's timings are steadier than these CPUs').
layouts() {
  local m=/tmp/llama-1b.gguf
  [ -f "$m" ] || step model-llama-1b "$B/flywheel" random-model --shape llama-1b --out "$m"
  for pair in "${@:-block row}" ; do
    set -- $pair
    step "bench-llama-1b-$1-$2" env FLYWHEEL_CUDA_DECODE="$1" FLYWHEEL_CUDA_BATCH="$2" \
      "$B/flywheel" bench --device cuda --model "$m" --prompt-tokens 512 --decode-tokens 64 \
      --batch 1,8,64 --runs 3 --kv-cache-dtype f16
    grep -E "^(model|test|pp|tg)" "$OUT/bench-llama-1b-$1-$2.log" | sed 's/^/    /' >>"$SUMMARY"
  done
}

# attention_kernels CONTEXT BATCHES: the 1B shape's decode after CONTEXT-token prompts, by the
# rows kernel and then the chunks kernel (FLYWHEEL_CUDA_ATTENTION), one after the other.
M1B=/tmp/llama-1b.gguf
attention_kernels() {
  [ -f "$M1B" ] || step model-llama-1b "$B/flywheel" random-model --shape llama-1b --out "$M1B"
  local ctx=$1 batches=$2
  shift 2
  local kernels=("$@")
  [ ${#kernels[@]} -gt 0 ] || kernels=(rows chunks)
  for a in "${kernels[@]}"; do
    FLYWHEEL_CUDA_ATTENTION=$a step "bench-llama-1b-ctx$ctx-$a" "$B/flywheel" bench --device cuda \
      --model "$M1B" --prompt-tokens 512 --decode-tokens 32 --decode-context "$ctx" \
      --batch "$batches" --runs 2 --kv-cache-dtype f16
    grep -E "^(model|test|pp|tg)" "$OUT/bench-llama-1b-ctx$ctx-$a.log" | sed 's/^/    /' >>"$SUMMARY"
  done
}

llama_bench() {
  step "llama-bench-$1" "$LLAMA_BENCH" -m "/tmp/$1.gguf" -ngl 99 -p 512 -n 64 -r 3
  grep -E "^\|" "$OUT/llama-bench-$1.log" | sed 's/^/    /' >>"$SUMMARY"
}

# llama.cpp's CUDA build of llama-bench for sm_90 (from gpu-llamacpp) into $LLAMA_BENCH.
build_llamacpp() {
  local L=gpu-llamacpp jobs=${1:-$(nproc)}
  [ -f "$L/llama.cpp.tar.gz" ] || { echo "no $L: run scripts/gpu-llamacpp and carry $L"; return 99; }
  rm -rf /tmp/llama.cpp && tar xzf "$L/llama.cpp.tar.gz" -C /tmp
  printf '%s\n' 'llama_add_compile_flags()' 'add_subdirectory(llama-bench)' >/tmp/llama.cpp/tools/CMakeLists.txt
  # The sdist ships the CUDA template instances' generator, not the instances (the first lent
  # run's configure stopped on the missing fattn-vec-instance-f16-f16.cu).
  (cd /tmp/llama.cpp/ggml/src/ggml-cuda/template-instances && python3 generate_cu_files.py)
  CMAKE=$(command -v cmake || true)
  if [ -z "$CMAKE" ]; then
    python3 -m zipfile -e "$L"/cmake-*.whl /tmp/cmake-wheel >/dev/null
    CMAKE=$(find /tmp/cmake-wheel -path '*/bin/cmake' | head -1)
    chmod +x "$CMAKE"
  fi
  step llamacpp-configure "$CMAKE" -S /tmp/llama.cpp -B /tmp/llama.cpp/build -DCMAKE_BUILD_TYPE=Release \
    -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=OFF -DBUILD_SHARED_LIBS=OFF \
    -DGGML_CUDA_NCCL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_OPENSSL=OFF
  step llamacpp-build "$CMAKE" --build /tmp/llama.cpp/build --target llama-bench -j "$jobs"
  [ -x "$LLAMA_BENCH" ] && echo "  built $LLAMA_BENCH" | tee -a "$SUMMARY"
}

# ncu's CSV (gpu__time_duration.sum per launch) in LOG summed by kernel name: per decode step
# where the launches include whole steps (counted by the embedding's launches), else in all.
ncu_table() {
  python3 - "$1" <<'PY'
import csv, sys, collections
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) == 15]
head = rows[0]; rows = [r for r in rows[1:] if r[0] != "ID"]
name, unit, value = head.index("Kernel Name"), head.index("Metric Unit"), head.index("Metric Value")
total = collections.Counter(); count = collections.Counter()
for r in rows:
    ns = float(r[value].replace(",", "")) * {"ns": 1, "nsecond": 1, "us": 1e3, "usecond": 1e3,
                                            "ms": 1e6, "msecond": 1e6}[r[unit]]
    total[r[name]] += ns; count[r[name]] += 1
steps = sum(v for k, v in count.items() if k.startswith("fw_embed")) or 1
print(f"{len(rows)} kernels over {steps} steps; kernel time per step: {sum(total.values())/steps/1e3:.1f} us")
for k, ns in total.most_common():
    print(f"{k:<28} {count[k]/steps:6.1f}/step {ns/steps/1e3:9.1f} us/step {ns/count[k]/1e3:8.2f} us each")
PY
}

# ncu's duration of each kernel in a stretch of eager batch-1 decode steps, summed per kernel name
# and per step, beside the step's measured time (is a step the kernels' time, or the host's?).
# profile [TAG [BENCH ARGS...]]: TAG names the logs (profile-1b$TAG.md), the arguments are
# added to the bench's (e.g. "-int8 --precision int8").
profile() {
  local m=/tmp/llama-1b.gguf tag=${1:-}
  shift || true
  [ -f "$m" ] || step model-llama-1b "$B/flywheel" random-model --shape llama-1b --out "$m"
  # Caches and clocks as they are in a run (ncu flushes the caches and locks base clocks by
  # default, which made every small kernel look latency-bound).
  step "ncu-llama-1b$tag" ncu --csv --metrics gpu__time_duration.sum --cache-control none \
    --clock-control none \
    --launch-skip 5000 --launch-count 780 "$B/flywheel" bench --device cuda --model "$m" \
    --prompt-tokens 64 --decode-tokens 64 --batch 1 --runs 1 --kv-cache-dtype f16 "$@"
  ncu_table "$OUT/ncu-llama-1b$tag.log" >"$OUT/profile-1b$tag.md"
  cat "$OUT/profile-1b$tag.md" | head -30 | tee -a "$SUMMARY"
}

# Where decode through an adapter goes (LoRA at batch 1 ran at 0.53x the base's, OFT 0.68x, on
# an H200): ncu's duration of the adapter kernels alone, graph nodes and eager launches.
profile_adapter() {
  local a=${1:-lora} m=/tmp/llama-1b.gguf
  [ -f "$m" ] || step model-llama-1b "$B/flywheel" random-model --shape llama-1b --out "$m"
  step "ncu-adapter-$a" ncu --csv --metrics gpu__time_duration.sum --cache-control none \
    --clock-control none --kernel-name-base function \
    --kernel-name 'regex:fw_(lora|oft|block_matmul|axpy|matmul1_f32|matmul_t4x8_f32)' \
    --launch-count 1500 "$B/flywheel" bench --device cuda --model "$m" --adapter "$a" \
    --prompt-tokens 64 --decode-tokens 32 --batch 1 --runs 1 --kv-cache-dtype f16
  ncu_table "$OUT/ncu-adapter-$a.log" | sed 's/^/    /' | tee "$OUT/profile-adapter-$a.md" | tee -a "$SUMMARY"
}

case "${1:-}" in
profile)
  profile
  ;;
profile-adapter)
  profile_adapter "${2:-lora}"
  ;;
all)
  STEP_S=100 step kernels "$B/kernels-cuda" --test-threads 1
  STEP_S=150 step forward "$B/cuda-forward" --test-threads 1
  export FLYWHEEL_BIN="$PWD/$B/flywheel" FLYWHEEL_DEVICE=cuda
  STEP_S=60 step http-server-device "$B/server-device"
  STEP_S=100 speed
  STEP_S=90 step memcheck-kernels compute-sanitizer --tool memcheck --error-exitcode 1 "$B/kernels-cuda" --test-threads 1
  ;;
check)
  step kernels "$B/kernels-cuda" --test-threads 1
  step forward "$B/cuda-forward" --test-threads 1
  step memcheck-kernels compute-sanitizer --tool memcheck --error-exitcode 1 "$B/kernels-cuda" --test-threads 1
  step memcheck-forward compute-sanitizer --tool memcheck --error-exitcode 1 "$B/cuda-forward" --test-threads 1
  FLYWHEEL_CUDA_TEST_QUICK=1 step racecheck compute-sanitizer --tool racecheck --error-exitcode 1 \
    "$B/kernels-cuda" --test-threads 1
  export FLYWHEEL_BIN="$PWD/$B/flywheel" FLYWHEEL_DEVICE=cuda
  step train env FLYWHEEL_REQUIRE_GPU=1 "$B/cuda-train" --test-threads 1
  step engine-scoring env FLYWHEEL_REQUIRE_GPU=1 "$B/engine-scoring"
  for t in server-device server server-sampling-rules server-structured server-scoring; do
    step "http-$t" "$B/$t"
  done
  ;;
speed)
  speed
  ;;
layouts)
  STEP_S=100 step kernels "$B/kernels-cuda" --test-threads 1
  STEP_S=120 step forward-warp-tile4x8 env FLYWHEEL_CUDA_DECODE=warp FLYWHEEL_CUDA_BATCH=tile4x8 \
    "$B/cuda-forward" --test-threads 1
  STEP_S=100 layouts "block row" "warp tile4x8" "warp tile2x16"
  ;;
next)
  # Each step bounded, and the command by DEADLINE; the most wanted first (a session's device
  # time may allow this one call): what was written without a GPU checked (the kernels, every
  # family's forward, train = serve alone, through the engine and over HTTP), then the speed of
  # the decode tiles (DecodeProduct::Tile4, Tile2: 4 or 2 rows a block, each value of x read once
  # for them) against the block layout, then the rest.
  STEP_S=50 step kernels "$B/kernels-cuda" --test-threads 1
  STEP_S=100 step forward "$B/cuda-forward" --test-threads 1
  # The training forward on the GPU (served = scored, bit for bit), alone and through the engine
  # (the host's draws beside the GPU, forks and penalties, included).
  FLYWHEEL_REQUIRE_GPU=1 STEP_S=40 step train "$B/cuda-train" --test-threads 1
  FLYWHEEL_REQUIRE_GPU=1 STEP_S=30 step engine-scoring "$B/engine-scoring"
  # (server-device: a learning adapter on the GPU trains from the served log-probs, bit for bit.)
  FLYWHEEL_BIN="$PWD/$B/flywheel" FLYWHEEL_DEVICE=cuda STEP_S=60 step http-server-device "$B/server-device"
  STEP_S=60 layouts "block tile4x8" "tile4 tile4x8" "tile2 tile4x8"
  FLYWHEEL_CUDA_DECODE=tile4 STEP_S=60 step forward-tile4 "$B/cuda-forward" --test-threads 1 \
    every_family graph_replays
  FLYWHEEL_CUDA_TEST_QUICK=1 STEP_S=60 step memcheck-kernels compute-sanitizer --tool memcheck \
    --error-exitcode 1 "$B/kernels-cuda" --test-threads 1
  # Int8 (lanes at up to 8 tokens, its pairs now unrolled; quads beyond).
  STEP_S=60 step bench-llama-1b-int8 "$B/flywheel" bench --device cuda --precision int8 \
    --model "$M1B" --prompt-tokens 512 --decode-tokens 64 --batch 1,8,64 --runs 3 --kv-cache-dtype f16
  grep -E "^(model|test|pp|tg)" "$OUT/bench-llama-1b-int8.log" | sed 's/^/    /' >>"$SUMMARY"
  # Attention split by GQA group against the chunks kernel's split (the kernels test checked
  # their bits above), at 2048 and 8000 positions.
  FLYWHEEL_CUDA_ATTENTION=groups STEP_S=60 step forward-groups "$B/cuda-forward" --test-threads 1 \
    every_family graph_replays
  STEP_S=50 attention_kernels 2048 1,8 chunks groups
  STEP_S=50 attention_kernels 8000 1 chunks groups
  STEP_S=90 profile
  FLYWHEEL_CUDA_ATTENTION=rows STEP_S=60 step forward-rows "$B/cuda-forward" --test-threads 1
  # Decode through LoRA with A·x a warp a value (the default) and a block a value (the kernels
  # test checked their bits above).
  for l in warp block; do
    FLYWHEEL_CUDA_LORA=$l STEP_S=60 step "bench-llama-1b-lora-$l" "$B/flywheel" bench --device cuda \
      --model "$M1B" --adapter lora --prompt-tokens 128 --decode-tokens 32 --batch 1,8 --runs 3 \
      --kv-cache-dtype f16
    grep -E "^(model|test|pp|tg|publish)" "$OUT/bench-llama-1b-lora-$l.log" | sed 's/^/    /' >>"$SUMMARY"
  done
  ;;
context)
  # Decode after long prompts by each attention kernel: the rows kernel (a block a (token,
  # head)) against the chunks kernel (the default: a query's positions split over up to 32
  # warps), at 8, 2048 and 8000 positions (the shape holds 8192); the rows kernel's forward first
  # (graphs = eager, against the CPU; the default's is the forward step's).
  STEP_S=60 step kernels "$B/kernels-cuda" --test-threads 1 attention
  FLYWHEEL_CUDA_ATTENTION=rows STEP_S=100 step forward-rows "$B/cuda-forward" --test-threads 1
  STEP_S=60 attention_kernels 2048 1,8
  STEP_S=60 attention_kernels 8000 1
  STEP_S=50 attention_kernels 8 1,8,64
  # ncu's times of decode attention at 2048 positions, each kernel.
  for a in rows chunks; do
    FLYWHEEL_CUDA_ATTENTION=$a STEP_S=40 step "ncu-attention-$a-ctx2048" ncu --kernel-name-base function \
      --kernel-name 'regex:fw_attention' --launch-skip 200 --launch-count 16 "$B/flywheel" bench \
      --device cuda --model "$M1B" --prompt-tokens 64 --decode-tokens 8 --decode-context 2048 \
      --batch 1 --runs 1 --kv-cache-dtype f16
  done
  ;;
int8)
  # The int8 products' lanes layout (the kernels test: every layout = the CPU's bits), the int8
  # forward (each step's distances printed), the 1B shape's int8 speed in each layout beside the
  # f32 products', decode at 8 positions by each attention kernel, racecheck of the kernels with
  # room (60 s was not enough: it stopped in the products' test), then decode at 8000 positions.
  STEP_S=50 step kernels "$B/kernels-cuda" --test-threads 1
  STEP_S=60 step forward-int8 "$B/cuda-forward" --test-threads 1 --nocapture int8
  [ -f "$M1B" ] || STEP_S=40 step model-llama-1b "$B/flywheel" random-model --shape llama-1b --out "$M1B"
  for p in int8-lanes int8-quads exact; do
    l=${p#int8-}
    [ "$p" = exact ] && l=
    FLYWHEEL_CUDA_INT8=$l STEP_S=60 step "bench-llama-1b-$p" "$B/flywheel" bench \
      --device cuda --precision "${p%-*}" --model "$M1B" --prompt-tokens 512 --decode-tokens 64 \
      --batch 1,8,64 --runs 3 --kv-cache-dtype f16
    grep -E "^(model|test|pp|tg)" "$OUT/bench-llama-1b-$p.log" | sed 's/^/    /' >>"$SUMMARY"
  done
  STEP_S=50 attention_kernels 8 1,8,64
  FLYWHEEL_CUDA_TEST_QUICK=1 STEP_S=200 step racecheck compute-sanitizer --tool racecheck \
    --error-exitcode 1 "$B/kernels-cuda" --test-threads 1
  STEP_S=60 attention_kernels 8000 1
  ;;
int8-profile)
  # The int8 forward (held to the int8-exact distance), ncu's times of each kernel in the 1B
  # shape's int8 decode at batch 1, decode at 8000 positions by each attention kernel.
  STEP_S=60 step forward-int8 "$B/cuda-forward" --test-threads 1 --nocapture int8
  STEP_S=90 profile -int8 --precision int8
  STEP_S=60 attention_kernels 8000 1
  ;;
adapters)
  STEP_S=150 step forward "$B/cuda-forward" --test-threads 1
  m=/tmp/llama-1b.gguf
  [ -f "$m" ] || step model-llama-1b "$B/flywheel" random-model --shape llama-1b --out "$m"
  for a in lora oft; do
    STEP_S=120 step "bench-llama-1b-$a" "$B/flywheel" bench --device cuda --model "$m" --adapter "$a" \
      --prompt-tokens 128 --decode-tokens 32 --batch 1,8 --runs 3 --kv-cache-dtype f16
    grep -E "^(model|test|pp|tg|publish)" "$OUT/bench-llama-1b-$a.log" | sed 's/^/    /' >>"$SUMMARY"
  done
  ;;
llamacpp)
  build_llamacpp
  ;;
race)
  # One command for a short lease: llama.cpp's CUDA build in the background on 14 of the 16
  # cores while the kernels and forward are checked and our speed runs go (graphs keep our
  # runs' CPU side small), then llama-bench on the same files once it is built (up to ~7 min).
  (STEP_S=400 build_llamacpp 14) &
  builder=$!
  STEP_S=100 step kernels "$B/kernels-cuda" --test-threads 1
  STEP_S=150 step forward "$B/cuda-forward" --test-threads 1
  STEP_S=120 speed
  while kill -0 "$builder" 2>/dev/null && [ "$SECONDS" -lt 430 ]; do sleep 5; done
  if [ -x "$LLAMA_BENCH" ]; then
    for shape in smollm2-135m llama-1b; do STEP_S=60 llama_bench "$shape"; done
  else
    echo "  llama-bench not built in time: see llamacpp-*.log" | tee -a "$SUMMARY"
    tail -5 "$OUT"/llamacpp-*.log 2>/dev/null
  fi
  ;;
*)
  echo "usage: scripts/gpu_proof.sh all|check|next|context|layouts|adapters|llamacpp|profile|profile-adapter [lora|oft]|speed|race" >&2
  exit 2
  ;;
esac
echo "  failed steps: $failed" | tee -a "$SUMMARY"
# A lent machine's call brings back at most 8 files: the step logs travel as one archive (beside
# summary.md and profile-1b.md), added to by each command of the session.
(cd "$OUT" && ls ./*.log >/dev/null 2>&1 && tar czf logs-$$.tar.gz ./*.log && rm -f ./*.log)
exit "$failed"
