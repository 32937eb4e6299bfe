#!/usr/bin/env bash
# One device call's GPU work, in order of what a GPU session must learn:
#   1. tests_cuda: the compiled CUDA kernels against the references (the tests marked `cuda`);
#   2. loss: the loss at the benchmark shapes (B 4096, K 100, D 128 and 512, fp32 and bf16
#      banks of 1M rows), fused op, module (checks off), torch.compile of the eager loss and
#      eager, forward / backward / both: wall time and the kernels alone (the calls captured
#      in one CUDA graph and replayed), peak memory, % of the read bandwidth;
#   3. train_step: one real training step, ResNet-50 (random weights, 224 px, batch 128) into
#      the loss over a bank of N 1M, K 100, D 512, against the compiled and eager loss,
#      pytorch-metric-learning's contrastive loss and the backbone alone;
#   4. long_lists: K 1000 at D 2048 over a bf16 bank, where the gathered bytes dominate.
# Each step runs under its own time limit: a limit is at least 1/0.7 of the step's expected
# time on a fresh machine, and the limits add up to at most 420 s, so the whole fits a
# 600-second device call with the machine's start beside it. A step that runs out of time
# keeps what it printed and the rows it wrote (<table>.csv.partial).
#
#     bash benchmarks/gpu_session.sh [DIR]              (DIR default: a fresh temporary directory)
#     GPU_STEPS="loss train_step" bash benchmarks/gpu_session.sh    (a rerun: those steps)
#     bash benchmarks/gpu_session.sh --smoke [DIR]      (every step on the CPU at tiny shapes;
#                                                        what needs a GPU says it was skipped)
#
# Everything lands in DIR: env.log, one log per step, one CSV (and plot) per benchmark, and
# summary.txt (each step's exit, time and the end of its log: its table). Where $OUT is set
# (the device machine), DIR is packed into $OUT/gpu_session.tgz and summary.txt copied beside
# it. The commit the figures belong to is $NNKLOSS_COMMIT when set (the device machine's copy
# of the tree has no .git), else git's. pytorch-metric-learning is not on every GPU image: put
# it on PYTHONPATH (e.g. its wheel unpacked under .whl/, then PYTHONPATH=$PWD/.whl); without
# it the pml row says it was skipped.
set -uo pipefail
smoke=0
if [ "${1:-}" = "--smoke" ]; then smoke=1; shift; fi
dir=${1:-$(mktemp -d)}
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)
cd "$(dirname "$0")/.."
: >"$dir/summary.txt"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export NNKLOSS_COMMIT=${NNKLOSS_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}

step() {  # step NAME SECONDS CMD...: run CMD under a timeout, log to DIR/NAME.log
    local name=$1 secs=$2
    shift 2
    case " env ${GPU_STEPS:-$name} " in *" $name "*) ;; *) return 0 ;; esac
    local t0=$SECONDS
    timeout "$secs" "$@" >"$dir/$name.log" 2>&1
    local rc=$?
    echo "== $name: exit $rc after $((SECONDS - t0)) s (limit $secs s)" | tee -a "$dir/summary.txt"
    tail -n 60 "$dir/$name.log" | tee -a "$dir/summary.txt"
}

if [ $smoke = 1 ]; then
    dev=(--device cpu)
    loss=(--B 8 --K 4 --D 16 --N 100 --dtype fp32 --no-isolate --read-mb 8
          --providers fused module_unchecked eager)
    long=(--B 4 --K 12 --D 32 --N 200 --dtype bf16 --no-isolate --read-mb 8
          --providers fused module_unchecked eager)
    train=(--arch resnet18 --batch 2 --image 32 --N 200 --K 8 --D 16 --warmup 0 --steps 1
           --providers none fused eager pml)
else
    dev=(--device cuda)
    loss=(--B 4096 --K 100 --D 128 512 --dtype fp32 bf16 --N 1000000 --reps 50
          --providers fused module_unchecked compile eager)
    long=(--B 1024 --K 1000 --D 2048 --dtype bf16 --N 1000000 --reps 50
          --providers fused module_unchecked compile eager)
    train=()
fi

step env 10 python3 -c "
import os, torch, triton
print('commit', os.environ['NNKLOSS_COMMIT'], 'torch', torch.__version__, 'triton',
      triton.__version__, 'device',
      torch.cuda.get_device_name() if torch.cuda.is_available() else 'none')"
nvidia-smi -L >>"$dir/env.log" 2>&1 || true
if [ $smoke = 1 ]; then
    step tests_cuda 10 echo "tests_cuda: skipped (a smoke run has no GPU)"
else
    step tests_cuda 200 python3 -m pytest -q -m cuda tests -p no:cacheprovider
fi
step loss 80 python3 benchmarks/bench_loss.py "${dev[@]}" "${loss[@]}" --modes fwd bwd fwd_bwd \
    --name loss --out "$dir"
step train_step 75 python3 benchmarks/bench_train_step.py "${dev[@]}" "${train[@]}" --out "$dir"
step long_lists 55 python3 benchmarks/bench_loss.py "${dev[@]}" "${long[@]}" \
    --modes fwd bwd fwd_bwd --name long_lists --out "$dir"

if [ -n "${OUT:-}" ]; then
    mkdir -p "$OUT"
    tar czf "$OUT/gpu_session.tgz" -C "$dir" .
    cp "$dir/summary.txt" "$OUT/summary.txt"
fi
echo "results in $dir"
