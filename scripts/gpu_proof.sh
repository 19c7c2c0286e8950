#!/usr/bin/env bash
# The GPU proof, on a lent GPU machine, from gpu-bundle/ (built here by scripts/gpu-bundle; the GPU
# machine has no Rust toolchain and no network). Two commands of under 10 minutes each:
#
#   scripts/gpu_proof.sh check   nvidia-smi; every kernel against the CPU's (each format; paged
#                                attention on random page tables; graph replay = eager); the
#                                forward of every dense family against the CPU's, graphs = eager
#                                bit for bit, adapters; compute-sanitizer memcheck and racecheck;
#                                the server's HTTP tests on --device cuda
#   scripts/gpu_proof.sh llamacpp  (optional, before speed; carry gpu-llamacpp from
#                                scripts/gpu-llamacpp in its own call) llama.cpp's CUDA build of
#                                llama-bench for sm_90 into gpu-bundle/llama-bench
#   scripts/gpu_proof.sh speed   random-weight models of the default model's shape and Llama 3.2
#                                1B's; prefill and decode at batch 1/8/32/64 through graphs and
#                                eagerly; the card's copy bandwidth; llama.cpp's CUDA build of the
#                                same files where gpu-bundle/llama-bench is present
#
# Results go to $OUT (the device tool's folder; ./gpu-proof-out without it): one log per step and
# summary.md, which docs/gpu.md quotes. Exit status: the number of failed steps.
set -uo pipefail
cd "$(dirname "$0")/.."
B=gpu-bundle
OUT=${OUT:-gpu-proof-out}
mkdir -p "$OUT"
SUMMARY="$OUT/summary.md"
failed=0
export FLYWHEEL_REQUIRE_GPU=1

# step NAME COMMAND...: run it with its output in $OUT/NAME.log, a line in the summary.
step() {
  local name=$1
  shift
  local t0=$SECONDS
  if "$@" >"$OUT/$name.log" 2>&1; then
    echo "- $name: ok ($((SECONDS - t0)) s)" | tee -a "$SUMMARY"
  else
    echo "- $name: FAILED ($((SECONDS - t0)) s): see $name.log" | tee -a "$SUMMARY"
    tail -20 "$OUT/$name.log"
    failed=$((failed + 1))
  fi
}

[ -x "$B/flywheel" ] || { echo "no $B/flywheel: run scripts/gpu-bundle first and carry $B"; exit 99; }
echo "# GPU proof (${1:-}, $(date -u +%F))" >>"$SUMMARY"
if ! nvidia-smi >"$OUT/nvidia-smi.log" 2>&1; then
  echo "  no GPU here (nvidia-smi failed): nothing to prove" | tee -a "$SUMMARY"
  exit 98
fi
grep -m1 -E "NVIDIA (H|A|L|B)[0-9]+" "$OUT/nvidia-smi.log" | sed 's/^/  card: /' | tee -a "$SUMMARY"

case "${1:-}" in
check)
  step kernels "$B/kernels-cuda" --test-threads 1
  step forward "$B/cuda-forward" --test-threads 1
  step memcheck-kernels compute-sanitizer --tool memcheck --error-exitcode 1 "$B/kernels-cuda" --test-threads 1
  step memcheck-forward compute-sanitizer --tool memcheck --error-exitcode 1 "$B/cuda-forward" --test-threads 1
  step racecheck compute-sanitizer --tool racecheck --error-exitcode 1 "$B/kernels-cuda" --test-threads 1
  export FLYWHEEL_BIN="$PWD/$B/flywheel" FLYWHEEL_DEVICE=cuda
  for t in server-device server server-sampling-rules server-structured server-scoring; do
    step "http-$t" "$B/$t"
  done
  ;;
speed)
  for shape in smollm2-135m llama-1b; do
    m=/tmp/$shape.gguf
    [ -f "$m" ] || "$B/flywheel" random-model --shape "$shape" --out "$m"
    step "bench-$shape" "$B/flywheel" bench --device cuda --model "$m" --prompt-tokens 512 \
      --decode-tokens 64 --batch 1,8,32,64 --runs 3 --kv-cache-dtype f16
    grep -E "^(model|test|pp|tg)" "$OUT/bench-$shape.log" | sed 's/^/    /' >>"$SUMMARY"
    if [ -x "$B/llama-bench" ]; then
      step "llama-bench-$shape" "$B/llama-bench" -m "$m" -ngl 99 -p 512 -n 64 -r 3
      grep -E "^\|" "$OUT/llama-bench-$shape.log" | sed 's/^/    /' >>"$SUMMARY"
    fi
  done
  ;;
llamacpp)
  L=gpu-llamacpp
  [ -f "$L/llama.cpp.tar.gz" ] || { echo "no $L: run scripts/gpu-llamacpp and carry $L"; exit 99; }
  rm -rf /tmp/llama.cpp && tar xzf "$L/llama.cpp.tar.gz" -C /tmp
  printf '%s\n' 'llama_add_compile_flags()' 'add_subdirectory(llama-bench)' >/tmp/llama.cpp/tools/CMakeLists.txt
  CMAKE=$(command -v cmake || true)
  if [ -z "$CMAKE" ]; then
    python3 -m zipfile -e "$L"/cmake-*.whl /tmp/cmake-wheel >/dev/null
    CMAKE=$(find /tmp/cmake-wheel -path '*/bin/cmake' | head -1)
    chmod +x "$CMAKE"
  fi
  step llamacpp-configure "$CMAKE" -S /tmp/llama.cpp -B /tmp/llama.cpp/build -DCMAKE_BUILD_TYPE=Release \
    -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=OFF -DBUILD_SHARED_LIBS=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
    -DLLAMA_BUILD_APP=OFF -DLLAMA_OPENSSL=OFF
  step llamacpp-build "$CMAKE" --build /tmp/llama.cpp/build --target llama-bench -j "$(nproc)"
  cp /tmp/llama.cpp/build/bin/llama-bench "$B/llama-bench" && echo "  built $B/llama-bench" | tee -a "$SUMMARY"
  ;;
*)
  echo "usage: scripts/gpu_proof.sh check|llamacpp|speed" >&2
  exit 2
  ;;
esac
echo "  failed steps: $failed" | tee -a "$SUMMARY"
exit "$failed"
