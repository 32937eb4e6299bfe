#!/usr/bin/env bash
# One call's worth of GPU work: CUDA correctness first, then the loss, refresh and classifier
# benchmarks.
# Meant for a bare GPU machine with torch/triton but no network and no install of nnkloss:
#     bash benchmarks/gpu_session.sh [OUTDIR]        (default: $OUT, else benchmarks/results)
# Logs and CSVs land in OUTDIR; the last lines printed are a short summary.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-benchmarks/results}}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
python3 - <<'PY' 2>&1 | tee "$out/env.txt"
import torch, triton
print("torch", torch.__version__, "triton", triton.__version__,
      "device", torch.cuda.get_device_name() if torch.cuda.is_available() else "none")
PY
# 1. Correctness: the whole suite with compiled CUDA kernels, then the CPU-interpreter checks.
python3 -m pytest -q tests -x -p no:cacheprovider 2>&1 | tee "$out/tests_cuda.log" | tail -3
TRITON_INTERPRET=1 python3 -m pytest -q tests -m interpreter -p no:cacheprovider 2>&1 \
    | tee "$out/tests_interpreter.log" | tail -3
# 2. Loss benchmark (fused / eager / compile), with the copy-bandwidth ceiling.
timeout 420 python3 benchmarks/bench_loss.py --copy-bandwidth --out "$out" 2>&1 \
    | tee "$out/bench_loss.log" | tail -20
# 3. Launch-configuration sweep of the fused forward at the largest shapes.
timeout 300 python3 benchmarks/tune_loss.py --B 4096 --K 100 256 --D 512 2048 --out "$out" 2>&1 \
    | tee "$out/tune_loss.log" | tail -10
# 4. Refresh benchmark on the GPU (torch backend; faiss only if carried).
timeout 300 python3 benchmarks/bench_refresh.py --device cuda --out "$out" 2>&1 \
    | tee "$out/bench_refresh.log" | tail -12
# 5. The kernel classifier's distances: the Triton kernel against the torch form and compile.
timeout 300 python3 benchmarks/bench_classifier.py --device cuda --out "$out" 2>&1 \
    | tee "$out/bench_classifier.log" | tail -10
