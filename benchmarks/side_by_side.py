"""One side-by-side measurement of a source tree, in a fresh process; prints one JSON line.

    python benchmarks/side_by_side.py TREE op B K D fp32|bf16   # forward, forward+backward
    python benchmarks/side_by_side.py TREE knn N                # kNN graph, D 128, k 100
    python benchmarks/side_by_side.py TREE eval N               # metrics.evaluate, D 128

``TREE`` is a checkout whose ``nnkloss`` is imported (two trees, alternating fresh processes,
best of several rounds: how docs/PERFORMANCE.md compares a change with its base). The op runs
the functional loss on a bank of 200,000 rows with value checks off, median of 21 calls after
3 warm-ups; ``THREADS`` (default 2) sets torch's thread count. Peak RSS in MB.
"""
import json
import os
import resource
import statistics
import sys
import time

tree, what = sys.argv[1], sys.argv[2]
sys.path.insert(0, tree)
os.environ.setdefault("NNKLOSS_GOVERN_THREADS", "0")  # an older tree: its thread governor off
import torch  # noqa: E402

torch.set_num_threads(int(os.environ.get("THREADS", "2")))
import nnkloss  # noqa: E402


def rss_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


out = {"tree": tree, "what": what, "args": sys.argv[3:], "threads": torch.get_num_threads()}
g = torch.Generator().manual_seed(0)
if what == "op":
    B, K, D = map(int, sys.argv[3:6])
    dt = {"fp32": torch.float32, "bf16": torch.bfloat16}[sys.argv[6]]
    N = 200_000
    centres = torch.randn(N, D, generator=g).to(dt)
    cl = torch.randint(0, 100, (N,), generator=g, dtype=torch.int32)
    idx = torch.randint(0, N, (B,), generator=g)
    nb = torch.randint(0, N, (B, K), generator=g, dtype=torch.int32)
    nb[:, 0] = idx.int()
    emb0 = centres[idx].float() + 0.1 * torch.randn(B, D, generator=g)
    labels = cl[idx]
    sigma = float(D) ** 0.5 * 0.5
    with nnkloss.value_checks(False):
        for mode in ("fwd", "fwd_bwd"):
            ts = []
            for _ in range(24):
                emb = emb0.clone().requires_grad_(mode == "fwd_bwd")
                t0 = time.perf_counter()
                loss = nnkloss.neighbour_kernel_loss(emb, labels, centres, cl, nb, sigma=sigma)
                if mode == "fwd_bwd":
                    loss.backward()
                ts.append(time.perf_counter() - t0)
            out[mode + "_ms"] = 1e3 * statistics.median(ts[3:])
elif what in ("knn", "eval"):
    N = int(sys.argv[3])
    x = torch.randn(N, 128, generator=g)
    labels = torch.randint(0, 100, (N,), generator=g)
    t0 = time.perf_counter()
    if what == "knn":
        nnkloss.knn(x, x, 100, exclude_self=True)
    else:
        from nnkloss.evaluation import metrics
        metrics.evaluate(x, labels)
    out["s"] = time.perf_counter() - t0
else:
    raise SystemExit(f"what must be op, knn or eval, got {what!r}")
out["peak_rss_mb"] = rss_mb()
print(json.dumps(out))
