#!/usr/bin/env bash
# One device call's worth of GPU work, sized for the 15 minutes of device time a session is
# lent (the machine's start, the transfers and the command together): the steps below have
# timeouts that add up to 530 s (the whole run took 392 s on an H200 at ea8736c, 446 s on one
# at 5eeaa8e, 241 s on an H100 at 52484b7 before the two small-batch steps were added). At
# 5eeaa8e, on a fresh machine, tune_loss (3 of its 4 shapes in 35 s) and tune_small_d128 (none
# in 25 s) ran out of time compiling their tiles, and took 37 s together rerun warm: their
# limits are now 50 and 40 s, taken from steps that had ended 6-14 s early there. So
# `run(command="...", timeout_s=570)` leaves room for the machine's start (30-40 s of the lease
# on the H100's two calls at 52484b7 and 0646941, 30 s on the H200 at ea8736c, whose call held
# 422 s of the 900: a second call of ~200 s fitted). In order of what the next GPU session
# must learn (the first, on an H200, measured the
# classifier's distances and the neighbour lists: docs/PERFORMANCE.md, "The GPU figures";
# bench_classifier.py and bench_refresh.py still run them):
#   1. correctness of the compiled CUDA kernels (the tests marked `cuda`; the whole suite and
#      the interpreter checks run in CI on CPU and would not fit);
#   2. the loss: fused / eager / torch.compile / the op inside torch.compile at two CUDA
#      shapes, fp32 and bf16 banks, with the device-to-device copy bandwidth as the limit;
#   3. with sigma and the centres trained too (the entry-terms kernel and the centre scatter);
#   4. CUDA graphs (reduce-overhead) with the bank held static, as a training loop holds it;
#   5. host against kernel time of one step (profile_step.py), the op's and the module's, the
#      module also with its lists by torch's ops (the one-launch lists' A/B);
#   6. a launch sweep around the launch rule: 1, 2 and 4 warps at B 4096, 2, 4 and 8 at B 128,
#      the forward-only build at B 4096, and in each the rule's tile with its list entries
#      prefetched.
# A step that runs out of time keeps what it printed: each benchmark prints every measurement
# as it finishes (bench_loss writes its CSV only at the end; its log has the figures).
#
#     bash benchmarks/gpu_session.sh [DIR]      (DIR default: a fresh temporary directory)
#     GPU_STEPS="bench_loss tune_loss" bash benchmarks/gpu_session.sh   (a rerun: those steps)
#
# Everything lands in DIR: env.txt, one log per step, the benchmarks' CSVs and plots, and
# summary.txt (the last lines of each log). Where $OUT is set (the device machine), DIR is
# also packed into $OUT/gpu_session.tgz and summary.txt copied beside it: two files, within
# what a device call brings back. The commit the figures belong to is $NNKLOSS_COMMIT when set
# (the device machine's copy of the tree has no .git), else git's.
set -uo pipefail
cd "$(dirname "$0")/.."
dir=${1:-$(mktemp -d)}
mkdir -p "$dir"
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
    tail -n 12 "$dir/$name.log" | tee -a "$dir/summary.txt"
}

step env 10 python3 -c "
import os, torch, triton
print('commit', os.environ['NNKLOSS_COMMIT'], 'torch', torch.__version__, 'triton',
      triton.__version__, 'device',
      torch.cuda.get_device_name() if torch.cuda.is_available() else 'none')"
nvidia-smi -L >>"$dir/env.log" 2>&1 || true
lscpu >>"$dir/env.log" 2>&1 || true  # the host's CPU: cores, SMT siblings, caches, model
# 1. The CUDA tests: every kernel compiled for this GPU against the references (78 s at
#    52484b7; at 0646941, with the small batches' longer tiles to compile, over 90 s; 117 s
#    at ea8736c on the H200).
step tests_cuda 150 python3 -m pytest -q -m cuda tests -p no:cacheprovider
# 2. The loss at B 4096, K 100, D 128 / 512, fp32 and bf16 banks of 1M rows (torch.compile
#    compiles once per shape), and the module's whole call as a training loop makes it after
#    its first step (checks off). Every bench_loss step here times with --timer wall
#    (back-to-back calls, what a training loop sees; the tables of the sessions up to ea8736c
#    used do_bench, whose L2 flush overlaps the host's launch of these host-bound calls, so
#    its figure was neither the wall time nor the kernels').
step bench_loss 100 python3 benchmarks/bench_loss.py --B 4096 --K 100 --D 128 512 \
    --dtype fp32 bf16 --providers fused eager compile fused_compile module_unchecked \
    --copy-bandwidth --timer wall --device cuda --out "$dir"
# 3. Sigma and the centres trained too: the entry-terms kernel and the centre scatter.
step bench_grads 22 python3 benchmarks/bench_loss.py --B 4096 --K 100 --D 128 --dtype fp32 \
    --providers fused eager --modes fwd_bwd --also-grad sigma centres --timer wall \
    --device cuda --out "$dir/grads"
# 4. CUDA graphs around the eager loss and around the op (the bank static), and around the
#    module's call as a user would compile it (module_compile: never timed; on the H200 at
#    ea8736c the eager step was host-bound, autograd's engine alone 120-180 us a backward).
step bench_graphs 45 python3 benchmarks/bench_loss.py --B 4096 --K 100 --D 128 --dtype fp32 \
    --providers compile fused_compile module_compile --modes fwd fwd_bwd \
    --compile-mode reduce-overhead \
    --timer wall --device cuda --out "$dir/graphs"
# 5. Where one step's time goes: the host's Python and launches, or the kernels; for the op
#    and for the module's call (1.5-2.6x the op's forward+backward at 52484b7). --parts times
#    the mean's one launch (kernels/counted_mean.py) beside the four torch ops it replaced,
#    and the counted mask's one comparison beside its two ops (not yet timed on a GPU).
step profile_step 30 python3 benchmarks/profile_step.py --device cuda --B 4096 --K 100 \
    --D 128 --calls 100 --top 12 --providers fused module module_torch_lists --parts
# 6. The launch rule (one warp a row up to 512 columns, two rows a training tile: measured on
#    an H100 at B 4096) against 1, 2 and 4 warps on this card (training forward; tiles of 1, 2
#    and 4 rows), and at a small batch with long lists (the Fashion-MNIST protocol's B 128,
#    K 1000, D 64; tiles of 1-128 rows, at most 128 elements a thread), where the rule
#    lengthens the tiles to 128 x 64 at 4 warps, and at B 128, K 100, D 128 (64 x 128 at 4
#    warps): timed as the default on an H200 at ea8736c and bc82787. At B 128 the sweep
#    takes 2, 4 and 8 warps (one warp was the slowest there on both cards): the same tiles at
#    8 warps keep 16 warps per SM on sm_80/90 (101-118 registers, the static report's small-
#    batch sweep rows) where 4 warps keep 12, so this A/B decides the rule's warps there.
#    The sweeps time each
#    kernel with the host taken out (tune_loss's default timer since bc82787; do_bench's
#    figures of these 15-60 us kernels were the host's launch when it outlasted the flush).
step tune_loss 50 python3 benchmarks/tune_loss.py --device cuda --B 4096 --K 100 \
    --D 128 512 --dtype fp32 bf16 --warps 1 2 4 --max-configs 9 --reps 30 --out "$dir"
step tune_small 30 python3 benchmarks/tune_loss.py --device cuda --B 128 --K 1000 --D 64 \
    --dtype fp32 --warps 2 4 8 --reps 30 --out "$dir"
step tune_small_d128 40 python3 benchmarks/tune_loss.py --device cuda --B 128 --K 100 \
    --D 128 --dtype fp32 --warps 2 4 8 --reps 30 --out "$dir"
#    The forward-only build at B 4096, D 128, where on the H200 at ea8736c compile's whole
#    forward (0.075 ms, do_bench) was at or below the op's kernel time: a few tiles around
#    the rule's 4 x 128 at one warp. Every tune_loss step also times the rule's tile with the
#    next tile's list entries prefetched (FwdConfig.prefetch_index, the rows with
#    prefetch_index 1): the sm_90 binary shows the list loop unpipelined, each tile waiting on
#    its entries and then on their rows.
step tune_fwd 15 python3 benchmarks/tune_loss.py --device cuda --B 4096 --K 100 --D 128 \
    --dtype fp32 --forward-only --warps 1 2 --max-configs 8 --reps 30 --out "$dir"
# 7. The loss at that small batch through the op, with the lengthened tiles as its default
#    (0646941's one-warp tiles: 0.50x compile forward, 0.70x forward+backward).
step bench_small 38 python3 benchmarks/bench_loss.py --B 128 --K 1000 --D 64 --N 1000000 \
    --dtype fp32 --providers fused compile --modes fwd fwd_bwd --timer wall --device cuda \
    --out "$dir/small"

# Steps that run only when GPU_STEPS names them (the default run's limits already fill a call):
# the kNN graph and the retrieval evaluation at 150K searched on this GPU, each against the
# same search on this machine's CPU in the same call (2026-11-27 at 5eeaa8e on an H200: the
# first of either on a GPU since the graph's at 496aa53).
#     GPU_STEPS="tests_search bench_refresh bench_eval" bash benchmarks/gpu_session.sh
# eval_threads: the evaluation at 150K on this machine's CPU at 1 to 16 threads, the search's
# parts timed (bench_eval --phases: GEMM, selection, each block's finish). On the H200's
# 16-core Xeon at 654dba3 it took 16.1 s against 22 s on the project's 2-core EPYC (1.4x for
# 8x the cores), unexplained; env.log's lscpu says whether those cores are SMT siblings.
# threads_room: the evaluation of 60,000 points on this machine's CPU idle and beside a 2-thread
# matmul process, at 1 thread, at all the CPUs fixed and at the default (governed): with a few
# busy threads the governors run the wide side on the CPUs left free (its "room"); before
# 2026-11-27 any busy thread that left fewer CPUs free than the full count sent them to one
# thread (never measured on more than 2 cores).
extra() {  # extra NAME SECONDS CMD...: a step run only when GPU_STEPS names it
    case " ${GPU_STEPS:-} " in *" $1 "*) step "$@" ;; esac
}
extra tests_search 150 python3 -m pytest -q -m cuda tests/test_bench_eval.py \
    tests/test_search.py -p no:cacheprovider
extra bench_refresh 60 python3 benchmarks/bench_refresh.py --device cuda --N 100000 1000000 \
    --D 128 --k 100 --backends torch --out "$dir"
extra bench_eval 120 bash -c "python3 benchmarks/bench_eval.py --N 150000 --providers nnkloss \
    --device cuda --out '$dir' && python3 benchmarks/bench_eval.py --N 150000 \
    --providers nnkloss --out '$dir'"
extra eval_threads 240 env NNKLOSS_GOVERN_THREADS=0 python3 benchmarks/bench_eval.py \
    --N 150000 --providers nnkloss --threads 1 2 4 8 16 --phases --out "$dir"
extra threads_room 150 python3 benchmarks/bench_threads.py --parts eval --loads idle matmul2 \
    --settings 1 "$(nproc)" default --eval-n 60000 --out "$dir"

if [ -n "${OUT:-}" ]; then
    mkdir -p "$OUT"
    tar czf "$OUT/gpu_session.tgz" -C "$dir" .
    cp "$dir/summary.txt" "$OUT/summary.txt"
fi
echo "results in $dir"
