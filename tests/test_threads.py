"""Issue 21: whose threads the CPU op runs on, the thread governor (fake clock), and the run
queue signal of other processes' demand (fabricated /proc and /sys trees)."""
import os
import sys

import pytest
import torch

from nnkloss import threads as nthreads
from nnkloss.threads import (RunQueue, ThreadGovernor, parse_loadavg_running, parse_task_state,
                             run_queue_unavailable)
from nnkloss.ops import cpu


def drive(gov, cost, units):
    """Feed ``units`` units whose duration is ``cost(threads, unit)``; returns the counts used."""
    used = []
    for u in range(units):
        n = gov.threads()
        used.append(n)
        gov.record(cost(n, u))
    return used


def test_governor_keeps_the_faster_count_and_backs_off():
    applied = []
    gov = ThreadGovernor(2, warmup=3, window=4, hold=10, max_hold=40, probe_budget=1.0,
                         apply=applied.append)
    used = drive(gov, lambda n, u: 1.0 if n == 1 else 2.0, 300)   # one thread is faster
    assert used[:3] == [1, 1, 1]                                  # warm-up at one thread
    assert gov.threads() == 1 and gov.events[0]["threads"] == 1
    assert gov.events[0]["cost_full"] == 2.0 and gov.events[0]["cost_one"] == 1.0
    holds = [e["hold"] for e in gov.events]
    assert holds[:4] == [10, 20, 40, 40]                          # confirmed: doubled, capped
    assert applied[:2] == [2, 1]                                  # probed 2, came back
    # a clearly worse side (2.0 > 1.5 x 1.0) is abandoned after two timed units: each probe
    # costs three units at two threads (one untimed switch unit + two)
    assert used.count(2) == 3 * len(gov.events)


def test_governor_moves_to_the_full_count_when_it_is_faster_and_ties_go_to_one():
    gov = ThreadGovernor(2, warmup=2, window=3, hold=5, max_hold=20)
    used = drive(gov, lambda n, u: 1.0 if n == 2 else 1.8, 80)
    assert gov.events[0]["threads"] == 2 and all(e["threads"] == 2 for e in gov.events)
    assert used[-20:].count(1) <= 3 + 1                           # later probes of 1: abandoned
    tie = ThreadGovernor(2, warmup=0, window=3, hold=5, margin=0.05)
    drive(tie, lambda n, u: 0.97 if n == 2 else 1.0, 20)           # within the margin: one
    assert tie.events and all(e["threads"] == 1 for e in tie.events)


def test_governor_follows_a_change_of_load():
    gov = ThreadGovernor(2, warmup=0, window=3, hold=8, max_hold=64, probe_budget=1.0)
    # idle (2 threads faster) for 100 units, then a competing process (1 thread faster)
    drive(gov, lambda n, u: (1.0 if n == 2 else 1.8) if u < 100 else (3.0 if n == 2 else 1.5),
          300)
    assert gov.events[-1]["threads"] == 1
    flip = [e for e in gov.events if e["threads"] == 1 and e["unit"] > 100][0]
    assert flip["unit"] < 100 + 64 + 2 * 4 + 1                    # within a (max) hold
    assert flip["hold"] == 8                                       # a change resets the back-off


def test_governor_gives_up_a_far_worse_count_after_one_unit_and_holds_within_its_budget():
    # beside a busy process a unit at the full count cost 27x one at one thread (measured)
    gov = ThreadGovernor(2, warmup=0, window=6, hold=10, max_hold=4096, probe_budget=0.05)
    used = drive(gov, lambda n, u: 1.0 if n == 1 else 27.0, 3000)
    first = gov.events[0]
    assert first["threads"] == 1 and first["cost_full"] == 27.0
    # one untimed switch unit + one timed unit at two threads, then back
    assert used[:9] == [1] * 6 + [2, 2] + [1]
    # that probe cost 2 x 26 extra units: the next is at least 52 / 0.05 = 1040 units later
    assert first["hold"] >= 1040
    assert used.count(2) * 26 <= 0.05 * len(used) + 2 * 26       # probes within the budget
    with pytest.raises(ValueError):
        ThreadGovernor(2, probe_budget=0.0)


def test_governor_uses_cost_per_unit_of_work_and_drops_switch_units():
    gov = ThreadGovernor(2, warmup=0, window=2, hold=100)
    seen = []
    for u in range(6):
        n = gov.threads()
        seen.append(n)
        work = 10.0 if u % 2 else 1.0
        # the unit right after a switch is slow (team resize): it must not count
        slow = 100.0 if u == 2 else 1.0
        gov.record(slow * work * (0.5 if n == 2 else 0.8), work=work)
    assert seen == [1, 1, 2, 2, 2, 2]
    assert gov.events[0]["threads"] == 2
    assert gov.events[0]["cost_full"] == 0.5 and gov.events[0]["cost_one"] == 0.8


def test_governor_ignores_units_at_another_count_and_a_single_thread():
    gov = ThreadGovernor(lambda: 1, warmup=0, window=2, hold=1)
    drive(gov, lambda n, u: 1.0, 10)
    assert gov.threads() == 1 and gov.events == []                # nothing to choose
    gov = ThreadGovernor(2, warmup=0, window=2, hold=5)
    for _ in range(10):
        gov.record(1.0, threads=3)                                 # not the governor's count
    assert gov.events == [] and gov.phase == "current"
    with pytest.raises(ValueError):
        ThreadGovernor(2, window=1)


def test_record_rejects_durations_and_work_it_cannot_time_by_name():
    """A NaN or infinite duration, a negative one, or a work of 0 / NaN: a ValueError naming the
    argument at the call, the governor unchanged. Before, NaN and inf reached the hold's
    arithmetic (a ValueError "cannot convert float NaN to integer" at the decision, units
    later), and a negative duration at the full count chose it with the longest hold."""
    nan, inf = float("nan"), float("inf")
    for bad in (nan, inf, -inf, -1.0):
        gov = ThreadGovernor(2, warmup=0, window=3, hold=5)
        with pytest.raises(ValueError, match="seconds"):
            gov.record(bad)
        assert gov.units == 0 and gov._elapsed == 0.0 and gov._costs == {}
    for bad in (0, -1.0, nan, inf):
        gov = ThreadGovernor(2, warmup=0, window=3, hold=5)
        with pytest.raises(ValueError, match="work"):
            gov.record(1.0, work=bad)
        assert gov.units == 0 and gov._costs == {}
    gov = ThreadGovernor(2, warmup=0, window=3, hold=5)
    gov.record(0.0)                                              # a coarse clock's 0: a unit
    assert gov.units == 1 and gov._costs == {"one": [0.0]}


def test_apply_may_call_back_into_the_governor():
    """``apply`` runs inside record() (the count changes there): an apply that logs summary()
    or calls skip_next() works. Before, record() held a plain lock and deadlocked on it."""
    import threading
    seen = []
    gov = ThreadGovernor(2, warmup=0, window=2, hold=5)
    gov.apply = lambda n: (seen.append((n, gov.summary()["threads"])), gov.skip_next())
    worker = threading.Thread(target=lambda: drive(gov, lambda n, u: 1.0 if n == 1 else 2.0,
                                                   20), daemon=True)
    worker.start()
    worker.join(timeout=30)
    assert not worker.is_alive(), "record() deadlocked in apply"
    assert seen[:2] == [(2, 2), (1, 1)] and gov.units == 20


# ------------------------------------------------------------------ the op's pool
@pytest.mark.skipif(not cpu.available(), reason="compiled CPU kernel unavailable")
def test_the_kernel_runs_on_torchs_openmp_pool_when_torch_has_one():
    info = cpu.build_info()
    if cpu.torch_libgomp() is None:
        assert info["pool"] == "own-threads"
        return
    assert info["pool"] == "torch-openmp"
    assert cpu.torch_libgomp() in cpu._loaded_libgomp()
    # the library asks for libgomp.so.1 (torch's soname), not another runtime
    import subprocess
    needed = subprocess.run(["readelf", "-d", info["path"]], capture_output=True,
                            text=True).stdout
    if needed:
        assert "[libgomp.so.1]" in needed


@pytest.mark.skipif(not cpu.available(), reason="compiled CPU kernel unavailable")
def test_op_results_are_identical_at_one_and_two_threads_governed_or_not(monkeypatch):
    import nnkloss
    g = torch.Generator().manual_seed(3)
    B, K, D, N = 256, 32, 64, 500   # above PARALLEL_MIN_ELEMS: two threads really run
    centres = torch.randn(N, D, generator=g, requires_grad=True)
    cl = torch.randint(0, 5, (N,), generator=g)
    nb = torch.randint(0, N, (B, K), generator=g)
    labels = cl[nb[:, 0]]
    emb = torch.randn(B, D, generator=g, requires_grad=True)

    def run():
        emb.grad = centres.grad = None
        loss = nnkloss.neighbour_kernel_loss(emb, labels, centres, cl, nb, sigma=3.0)
        loss.backward()
        return loss.detach(), emb.grad.clone(), centres.grad.clone()

    old = torch.get_num_threads()
    results = []
    try:
        for govern in ("0", "1"):
            monkeypatch.setenv("NNKLOSS_GOVERN_THREADS", govern)
            for n in (1, 2, 1, 2):
                torch.set_num_threads(n)
                for _ in range(3):
                    results.append(run())
    finally:
        torch.set_num_threads(old)
    for r in results[1:]:
        for a, b in zip(results[0], r):
            assert torch.equal(a, b)


# ------------------------------------------------------------------ the Trainer's governor
def _softmax_trainer(**kw):
    from torch import nn
    from torch.utils.data import DataLoader
    from nnkloss.experiment.datasets import IndexedTensorDataset
    from nnkloss.experiment.models import SoftmaxHead
    from nnkloss.experiment.train import Trainer
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 8, generator=g), torch.randint(0, 3, (64,), generator=g)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    loader = DataLoader(IndexedTensorDataset(x, y), batch_size=8, shuffle=True)
    return Trainer(model, SoftmaxHead(4, 3), loader, progress=False, lr=1e-2, **kw)


def test_trainer_governor_logs_its_choices_and_restores_the_count(monkeypatch):
    old = torch.get_num_threads()
    seen = []
    try:
        torch.set_num_threads(2)
        gov = ThreadGovernor(2, warmup=0, window=2, hold=3, probe_budget=1.0)
        # a clock where one thread is always faster: each step at 2 threads "takes" 1 s more
        real = gov.record
        monkeypatch.setattr(gov, "record", lambda s, *a, **k: (
            seen.append(torch.get_num_threads()),
            real(1.0 + (torch.get_num_threads() == 2), *a, **k))[-1])
        tr = _softmax_trainer(threads=gov)
        tr.fit(3)
        assert torch.get_num_threads() == 2                      # restored
    finally:
        torch.set_num_threads(old)
    assert 1 in seen and 2 in seen                               # it did switch torch's count
    last = tr.history[-1]
    assert last["threads_decisions"] >= 2 and last["threads_step_ms_full"] == 2000.0
    assert last["threads_step_ms_one"] == 1000.0
    assert all("threads" in row for row in tr.history)


def test_trainer_governor_with_a_busy_signal_stays_at_one_thread_and_logs_it():
    old = torch.get_num_threads()
    seen = []
    sig = FakeSignal()
    sig.now = 2                                                  # 2 others on 2 cores
    try:
        torch.set_num_threads(2)
        gov = ThreadGovernor(2, warmup=0, window=2, hold=3, signal=sig)
        real = gov.record
        gov.record = lambda s, *a, **k: (seen.append(torch.get_num_threads()),
                                         real(s, *a, **k))[-1]
        tr = _softmax_trainer(threads=gov)
        tr.fit(3)
    finally:
        torch.set_num_threads(old)
    assert seen and set(seen) == {1}                             # never probed 2 threads
    last = tr.history[-1]
    assert last["threads"] == 1 and last["threads_by_signal"] == last["threads_decisions"] > 0
    assert last["threads_step_ms_full"] is None and last["threads_step_ms_one"] > 0


def test_trainer_builds_the_initial_bank_at_the_runs_thread_count(monkeypatch):
    from nnkloss.experiment.bank_upkeep import BankUpkeep
    seen = []
    real = BankUpkeep.before_fit
    monkeypatch.setattr(BankUpkeep, "before_fit", lambda self, *a, **k: (
        seen.append(torch.get_num_threads()), real(self, *a, **k))[-1])
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        _softmax_trainer(threads=1).fit(1)
        _softmax_trainer(threads=ThreadGovernor(2, warmup=3)).fit(1)   # starts at one
        assert torch.get_num_threads() == 2                      # restored
    finally:
        torch.set_num_threads(old)
    assert seen == [1, 1]


def test_trainer_threads_int_none_and_bad_values(monkeypatch):
    monkeypatch.setenv("NNKLOSS_GOVERN_THREADS", "1")  # conftest turns the governors off
    old = torch.get_num_threads()
    counts = []
    try:
        torch.set_num_threads(2)
        tr = _softmax_trainer(threads=1, eval_fn=lambda m, c, e: counts.append(
            torch.get_num_threads()) or {})
        tr.fit(1)
        assert counts == [1] and torch.get_num_threads() == 2
        assert tr.governor is None and "threads" not in tr.history[-1]
        assert _softmax_trainer(threads=None).governor is None
        auto = _softmax_trainer().governor                        # "auto" on a CPU, 2 threads
        assert auto is not None
        # with the run queue signal where it describes our CPUs (Linux, not a container slice)
        from nnkloss.threads import run_queue
        assert auto.signal is run_queue()
        torch.set_num_threads(1)
        assert _softmax_trainer().governor is None                # nothing to choose
    finally:
        torch.set_num_threads(old)
    for bad in (0, "two", True, 1.5):
        with pytest.raises(ValueError, match="threads"):
            _softmax_trainer(threads=bad)


# ------------------------------------------------------------------ the run queue signal
def _stat(tid, comm, state):
    return f"{tid} ({comm}) {state} 1 1 0 0 -1 4194560 0 0 0 0 3 1 0 0 20 0 4 0 100 0 0\n"


def fake_proc(root, running=5, total=120, tasks=(("python", "R"), ("python", "S"))):
    """A /proc tree with loadavg, self/stat, self/cgroup and self/task/<tid>/stat."""
    (root / "self" / "task").mkdir(parents=True)
    (root / "loadavg").write_text(f"0.84 0.66 0.82 {running}/{total} 22517\n")
    (root / "self" / "stat").write_text(_stat(100, "python", "R"))
    (root / "self" / "cgroup").write_text("0::/\n")
    for i, (comm, state) in enumerate(tasks):
        d = root / "self" / "task" / str(100 + i)
        d.mkdir()
        (d / "stat").write_text(_stat(100 + i, comm, state))
    return root


def test_parsers_read_the_run_queue_and_a_state_after_an_odd_command_name():
    assert parse_loadavg_running("0.84 0.66 0.82 4/90 22517\n") == 4
    assert parse_loadavg_running(b"12.00 3.1 2.0 17/1203 9") == 17
    # a command name may hold spaces and ')' (even ") R ("): the state follows the last ')'
    assert parse_task_state(_stat(7, "a) R (b", "S")) == "S"
    assert parse_task_state(_stat(7, "my worker)", "R").encode()) == "R"
    assert parse_task_state(_stat(7, "pt_main_thread", "D")) == "D"
    for bad in ("0.84 0.66 0.82", "0.1 0.1 0.1 x/90 1", "0.1 0.1 0.1 -1/90 1"):
        with pytest.raises((ValueError, IndexError)):
            parse_loadavg_running(bad)
    for bad in ("7 python S 1", "7 (python)"):
        with pytest.raises((ValueError, IndexError)):
            parse_task_state(bad)


def test_run_queue_counts_the_others_less_our_own_runnable_threads(tmp_path):
    # 5 runnable on the machine; ours: two R (one named "x) R (y"), one S, one R with ')'
    proc = fake_proc(tmp_path, running=5, tasks=(("python", "R"), ("x) S (y", "R"),
                                                 ("a) R (b", "S"), ("omp)", "R")))
    ticks = iter([1.0, 1.000040])
    rq = RunQueue(2, proc=str(proc), clock=lambda: next(ticks))
    assert rq.own_running() == 3
    assert rq.sample() == 2 and rq.cost == pytest.approx(40e-6)
    (proc / "loadavg").write_text("0.1 0.1 0.1 3/120 1\n")      # only ours (and the reader)
    rq.clock = lambda: 0.0
    assert rq.sample() == 0
    (proc / "loadavg").write_text("0.1 0.1 0.1 1/120 1\n")      # a race: never negative
    assert rq.sample() == 0


def test_run_queue_skips_a_thread_that_ended_and_fails_for_good_on_a_read_error(tmp_path):
    proc = fake_proc(tmp_path, running=4)
    rq = RunQueue(2, proc=str(proc))
    (proc / "self" / "task" / "101").mkdir(exist_ok=True)
    (proc / "self" / "task" / "101" / "stat").unlink()          # listed, gone when read
    assert rq.sample() == 3 and rq.failed is None
    (proc / "loadavg").write_text("garbage\n")
    assert rq.sample() is None and rq.failed                    # unparsable: no exception
    (proc / "loadavg").write_text("0.1 0.1 0.1 4/120 1\n")
    assert rq.sample() is None                                   # stays failed: timing alone
    rq2 = RunQueue(2, proc=str(tmp_path / "nowhere"))
    assert rq2.sample() is None and rq2.failed


def test_run_queue_is_unavailable_where_it_does_not_describe_our_cpus(tmp_path):
    proc = fake_proc(tmp_path / "proc")
    cg = tmp_path / "cgroup"
    cg.mkdir()

    def why(**kw):
        kw.setdefault("platform", "linux")
        kw.setdefault("proc", str(proc))
        kw.setdefault("cgroup_root", str(cg))
        kw.setdefault("cpu_count", lambda: 2)
        kw.setdefault("affinity", lambda: 2)
        return run_queue_unavailable(**kw)

    assert why() is None
    assert "Linux" in why(platform="darwin") and "Linux" in why(platform="win32")
    assert "CPUs" in why(cpu_count=lambda: 64, affinity=lambda: 2)   # pinned / container
    assert why(cpu_count=lambda: None) is not None
    assert "/proc" in why(proc=str(tmp_path / "noproc"))
    # cgroup v2: "max ..." is no quota, a number is one (at the root or at our own cgroup)
    (cg / "cpu.max").write_text("max 100000\n")
    assert why() is None
    (cg / "cpu.max").write_text("150000 100000\n")
    assert "quota" in why()
    (cg / "cpu.max").unlink()
    (proc / "self" / "cgroup").write_text("0::/job/42\n")
    (cg / "job" / "42").mkdir(parents=True)
    (cg / "job" / "42" / "cpu.max").write_text("50000 100000\n")
    assert "job/42/cpu.max" in why()
    (cg / "job" / "42" / "cpu.max").write_text("max 100000\n")
    assert why() is None
    # a parent's quota limits us as much as our own (a slice above the job)
    (cg / "job" / "cpu.max").write_text("100000 100000\n")
    assert "job/cpu.max" in why()
    (cg / "job" / "cpu.max").write_text("max 100000\n")
    assert why() is None
    # cgroup v1: cpu.cfs_quota_us, -1 = none
    (proc / "self" / "cgroup").write_text("4:cpu,cpuacct:/docker/abc\n0::/\n")
    (cg / "cpu,cpuacct" / "docker" / "abc").mkdir(parents=True)
    (cg / "cpu,cpuacct" / "cpu.cfs_quota_us").write_text("-1\n")
    (cg / "cpu,cpuacct" / "docker" / "abc" / "cpu.cfs_quota_us").write_text("-1\n")
    assert why() is None
    (cg / "cpu,cpuacct" / "docker" / "abc" / "cpu.cfs_quota_us").write_text("200000\n")
    assert "cfs_quota_us" in why()
    (cg / "cpu,cpuacct" / "docker" / "abc" / "cpu.cfs_quota_us").write_text("-1\n")
    (cg / "cpu,cpuacct" / "docker" / "cpu.cfs_quota_us").write_text("50000\n")
    assert "docker/cpu.cfs_quota_us" in why()
    (cg / "cpu,cpuacct" / "docker" / "cpu.cfs_quota_us").write_text("-1\n")
    assert why() is None
    (cg / "cpu,cpuacct" / "docker" / "abc" / "cpu.cfs_quota_us").write_text("200000\n")
    (cg / "cpu,cpuacct" / "docker" / "abc" / "cpu.cfs_quota_us").write_text("lots\n")
    assert "unparsable" in why()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux /proc")
def test_run_queue_on_this_machine_counts_our_running_thread():
    why = run_queue_unavailable()
    if why is not None:
        assert nthreads.run_queue() is None
        return
    rq = nthreads.run_queue()
    assert rq is nthreads.run_queue() and rq.cores == len(os.sched_getaffinity(0))
    assert rq.own_running() >= 1                                 # the thread reading it
    others = rq.sample()
    assert isinstance(others, int) and others >= 0 and rq.cost > 0


# ------------------------------------------------------------------ the governor with a signal
class FakeSignal:
    """``others`` of unit u is ``load(u)`` (set by :func:`drive_loaded` before each unit)."""

    def __init__(self, cores=2, cost=0.0):
        self.cores, self.cost, self.now, self.samples = cores, cost, 0, 0

    def sample(self):
        self.samples += 1
        return self.now


def drive_loaded(gov, sig, load, cost, units):
    """:func:`drive` with the signal reading ``load(u)`` during unit u."""
    used = []
    for u in range(units):
        sig.now = load(u)
        n = gov.threads()
        used.append(n)
        gov.record(cost(n, u))
    return used


def _strip(events):
    return [{k: v for k, v in e.items() if k not in ("by", "others")} for e in events]


def test_no_probe_of_the_full_count_while_other_processes_fill_the_cores():
    # beside a 2-thread process (others 2 on 2 cores) a unit at 2 threads costs 27x (measured)
    slow = lambda n, u: 1.0 if n == 1 else 27.0                          # noqa: E731
    sig = FakeSignal()
    gov = ThreadGovernor(2, warmup=3, window=4, hold=10, signal=sig)
    used = drive_loaded(gov, sig, lambda u: 2, slow, 300)
    assert used.count(2) == 0                                    # never probed
    assert gov.events and all(e["by"] == "signal" and e["action"] == "skipped"
                              and e["threads"] == 1 and e["hold"] == 10 for e in gov.events)
    assert gov.events[0]["unit"] == 3 + 4                        # warm-up, then the window
    summary = gov.summary()
    assert summary["by_signal"] == summary["skipped"] == len(gov.events) and summary["signal"]
    assert summary["others"] == 2
    # the same run timed alone probes 2 threads (and pays for it)
    alone = ThreadGovernor(2, warmup=3, window=4, hold=10)
    assert drive(alone, slow, 300).count(2) > 0
    # one other thread on 2 cores is enough (2 threads 1.5x slower there, measured); on 8
    # cores a 2-thread count has room beside 6 others, not beside 7
    for cores, others, probes in ((2, 1, False), (2, 0, True), (8, 6, True), (8, 7, False)):
        sig = FakeSignal(cores=cores)
        gov = ThreadGovernor(2, warmup=0, window=2, hold=5, signal=sig)
        used = drive_loaded(gov, sig, lambda u: others, slow, 30)
        assert (2 in used) == probes, (cores, others)


def test_the_probe_resumes_within_a_hold_when_the_others_leave():
    fast2 = lambda n, u: 1.0 if n == 2 else 1.8                          # noqa: E731
    sig = FakeSignal()
    gov = ThreadGovernor(2, warmup=0, window=3, hold=8, max_hold=512, signal=sig)
    used = drive_loaded(gov, sig, lambda u: 2 if u < 100 else 0, fast2, 200)
    assert used[:100].count(2) == 0
    first = next(e for e in gov.events if e["by"] == "timing")
    assert first["threads"] == 2 and first["unit"] > 100
    assert first["unit"] <= 100 + 8 + 2 * 3 + 1                 # within a (base) hold
    assert used[first["unit"]:first["unit"] + 50] == [2] * 50


def test_the_full_count_is_dropped_when_the_others_arrive_and_kept_through_a_blip():
    fast2 = lambda n, u: 1.0 if n == 2 else 1.8                          # noqa: E731
    sig = FakeSignal()
    gov = ThreadGovernor(2, warmup=0, window=3, hold=8, max_hold=4096, signal=sig)
    # idle, then a single busy reading at unit 60 (a moment's burst), then a competitor at 100
    load = lambda u: 2 if u == 60 or u >= 100 else 0                     # noqa: E731
    used = drive_loaded(gov, sig, load, fast2, 200)
    assert used[50:70] == [2] * 20                               # one busy sample: kept
    drop = [e for e in gov.events if e.get("action") == "dropped"]
    assert len(drop) == 1 and drop[0]["unit"] == 102             # the second busy unit
    assert drop[0]["threads"] == 1 and drop[0]["others"] == 2 and drop[0]["hold"] == 8
    assert used[102:] == [1] * 98                                # and no probe since
    assert all(e["action"] == "skipped" for e in gov.events[-5:])
    assert gov.summary()["dropped"] == 1
    # timed alone, the same run keeps 2 threads through its long hold
    alone = ThreadGovernor(2, warmup=0, window=3, hold=8, max_hold=4096)
    assert drive(alone, fast2, 200)[102:120] == [2] * 18


def test_a_drop_ends_a_probe_of_the_full_count():
    sig = FakeSignal()
    gov = ThreadGovernor(2, warmup=0, window=6, hold=10, signal=sig)
    # room when the window's samples are taken, none once 2 threads run (the others resume)
    used = drive_loaded(gov, sig, lambda u: 0 if u < 6 else 2, lambda n, u: 1.0, 30)
    assert used[:10] == [1] * 6 + [2, 2] + [1, 1]
    assert gov.events[0]["action"] == "dropped" and gov.events[0]["unit"] == 8
    assert gov.events[0]["cost_one"] == 1.0 and gov.events[0]["cost_full"] is None
    assert used[8:] == [1] * 22                                  # a hold, then no probe
    assert [e["action"] for e in gov.events] == ["dropped", "skipped"]


def test_one_busy_reading_in_the_window_does_not_decide():
    fast2 = lambda n, u: 1.0 if n == 2 else 1.8                          # noqa: E731
    # window of 4 at one thread: units 0-3 sampled, then a fresh sample at the decision
    # (the median of the last three: a momentary reading, even the freshest, is outvoted)
    for readings, probes in (([0, 0, 0, 0, 2], True), ([2, 2, 2, 2, 0], False),
                             ([0, 0, 0, 2, 0], True), ([0, 0, 0, 2, 2], False),
                             ([2, 2, 2, 0, 0], True)):
        sig = FakeSignal()
        it = iter(readings + [0] * 100)
        sig.sample = lambda it=it: next(it)
        gov = ThreadGovernor(2, warmup=0, window=4, hold=50, signal=sig)
        used = drive(gov, fast2, 10)
        assert (2 in used) == probes, readings


def test_with_an_idle_signal_the_governor_decides_as_by_timing_alone():
    cases = [(lambda n, u: 1.0 if n == 1 else 2.0, dict(warmup=3, window=4, hold=10,
                                                        max_hold=40, probe_budget=1.0)),
             (lambda n, u: 1.0 if n == 2 else 1.8, dict(warmup=2, window=3, hold=5,
                                                        max_hold=20)),
             (lambda n, u: (1.0 if n == 2 else 1.8) if u < 100 else (3.0 if n == 2 else 1.5),
              dict(warmup=0, window=3, hold=8, max_hold=64, probe_budget=1.0)),
             (lambda n, u: 1.0 if n == 1 else 27.0, dict(warmup=0, window=6, hold=10))]
    for cost, kw in cases:
        alone = ThreadGovernor(2, **kw)
        sig = FakeSignal()
        signalled = ThreadGovernor(2, signal=sig, **kw)
        assert drive(alone, cost, 400) == drive_loaded(signalled, sig, lambda u: 0, cost, 400)
        assert _strip(alone.events) == _strip(signalled.events)
        assert all(e["by"] == "timing" for e in signalled.events) and sig.samples > 0
        assert signalled.summary()["by_signal"] == 0


def test_a_signal_that_fails_leaves_the_governor_timing_alone(tmp_path):
    slow = lambda n, u: 1.0 if n == 1 else 27.0                          # noqa: E731
    kw = dict(warmup=3, window=4, hold=10)
    reference = drive(ThreadGovernor(2, **kw), slow, 200)

    class Raises:
        cores = 2

        def sample(self):
            raise OSError("no /proc")

    gov = ThreadGovernor(2, signal=Raises(), **kw)
    assert drive(gov, slow, 200) == reference                    # no exception, timing alone
    assert gov.signal is None and gov.summary()["signal"] is False
    # a RunQueue whose /proc read fails returns None and stays failed
    proc = fake_proc(tmp_path, running=4)
    rq = RunQueue(2, proc=str(proc))
    (proc / "loadavg").unlink()
    gov = ThreadGovernor(2, signal=rq, **kw)
    assert drive(gov, slow, 200) == reference
    assert rq.failed and gov.signal is None and all(e["by"] == "timing" for e in gov.events)


def test_a_signal_reading_that_is_not_a_count_is_a_failed_signal():
    """sample() returning NaN, inf or text: the signal is dropped (timing alone), no exception
    (before, int() of it raised inside record() and in the constructor with start="auto");
    a negative reading is 0 (before, it made room for more CPUs than the machine has: the
    wide count above the cores). A signal without a valid ``cores`` is refused when the
    governor is built, by name (before, int(signal.cores) raised in record())."""
    slow = lambda n, u: 1.0 if n == 1 else 27.0                          # noqa: E731
    kw = dict(warmup=3, window=4, hold=10)
    reference = drive(ThreadGovernor(2, **kw), slow, 200)
    for bad in (float("nan"), float("inf"), "two"):
        for start in ("one", "auto"):
            sig = FakeSignal()
            sig.now = bad
            gov = ThreadGovernor(2, signal=sig, start=start, **kw)
            assert gov.threads() == 1, (bad, start)
            assert drive(gov, slow, 200) == reference, (bad, start)
            assert gov.signal is None and not gov.summary()["signal"], (bad, start)
    sig = FakeSignal(cores=2)
    sig.now = -3                                                 # "room" for 5 on 2 cores
    gov = ThreadGovernor(4, signal=sig, start="auto", **kw)
    assert gov.threads() == 2 and gov.others == 0 and gov.summary()["others"] == 0
    for cores in (None, 0, -2, 2.5, "2", True):
        sig = FakeSignal(cores=cores)
        with pytest.raises(ValueError, match="signal.cores"):
            ThreadGovernor(2, signal=sig, **kw)
    assert ThreadGovernor(2, signal=FakeSignal(cores=torch.tensor(2).item()), **kw).signal


def test_a_signal_lost_at_a_narrowed_count_gives_the_full_count_back():
    """16 cores, others 4: the wide side runs on the 12 free CPUs; then the signal fails. From
    there the governor times alone, between the full count and one thread: the full count is
    applied at once (the unit after it not timed). Before, the room of the last samples
    capped the wide side at 12 for good."""
    scales = lambda n, u: 16.0 / n                                       # noqa: E731

    class Fails(FakeSignal):
        fail = False

        def sample(self):
            if self.fail:
                raise OSError("no /proc")
            return super().sample()

    applied = []
    sig = Fails(cores=16)
    gov = ThreadGovernor(16, warmup=0, window=3, hold=1000, max_hold=1000, signal=sig,
                         start="auto", apply=applied.append)
    used = drive_loaded(gov, sig, lambda u: 4, scales, 100)
    assert used[-50:] == [12] * 50 and gov.wide == 12
    assert gov.phase == "hold" and gov.left > 100
    sig.fail = True
    units, left = gov.units, gov.left
    used = drive(gov, scales, 100)
    assert gov.signal is None and used == [12] + [16] * 99 and applied[-1] == 16
    assert gov.wide == 16 and gov.summary()["wide"] == 16
    assert gov.left == left - (100 - 2)          # the unit of the loss and the next: untimed
    assert gov.units == units + 100


def test_samples_are_spaced_by_their_cost():
    sig = FakeSignal(cost=1e-3)       # a 1 ms read, 1% budget: one per 0.1 s of recorded work
    gov = ThreadGovernor(2, warmup=0, window=3, hold=1000, signal=sig, sample_budget=0.01)
    drive_loaded(gov, sig, lambda u: 0, lambda n, u: 0.01 if n == 2 else 0.018, 1000)
    assert gov.threads() == 2                                    # idle: timing chose 2
    # ~10 s of work at 2 threads: about 100 samples (+ one forced at the probe), not 1000
    assert 80 <= sig.samples <= 120
    with pytest.raises(ValueError):
        ThreadGovernor(2, sample_budget=0.0)


def test_skipped_probes_keep_their_samples_within_the_budget_when_units_are_short():
    # 0.25 ms units and 130 us reads (a read beside a busy 2-thread process on the 2-core VM):
    # a forced read per skipped probe every 50 + 5 units alone would be 1.9% of the time
    unit = 0.25e-3
    fast2 = lambda n, u: unit if n == 1 else unit / 1.8                  # noqa: E731
    for budget in (0.01, 0.0025):
        sig = FakeSignal(cost=130e-6)
        gov = ThreadGovernor(2, warmup=3, window=5, hold=50, max_hold=3200, signal=sig,
                             sample_budget=budget)
        busy = 40000
        used = drive_loaded(gov, sig, lambda u: 2, fast2, busy)
        assert used.count(2) == 0
        skips = [e for e in gov.events if e["action"] == "skipped"]
        assert len(skips) > 10 and all(e["hold"] > 50 for e in skips)
        assert sig.samples * sig.cost <= budget * busy * unit * 1.02
        # the competitor leaves: the probe of 2 threads comes within the lengthened hold
        longest = max(e["hold"] for e in skips)
        used = drive_loaded(gov, sig, lambda u: 0, fast2, longest + 200)
        assert 2 in used and used.index(2) <= longest + 5 + 2
    # long units (5 ms): the base hold already keeps the reads within the budget
    sig = FakeSignal(cost=130e-6)
    gov = ThreadGovernor(2, warmup=3, window=5, hold=50, signal=sig, sample_budget=0.01)
    drive_loaded(gov, sig, lambda u: 2, lambda n, u: 5e-3, 2000)
    assert all(e["hold"] == 50 for e in gov.events)


def test_holds_stay_within_max_hold_for_extreme_costs():
    """Costs whose ratio overflows (a winner of ~0 s per unit of work against a long loser;
    two infinite costs per unit of work) and a signal whose sample cost is huge, infinite or
    NaN: the holds stay between 1 and max_hold, no exception. Before, int() of the inf or NaN
    raised inside record() ("cannot convert float NaN to integer")."""
    for one, full, work in ((1e-300, 1e300, 1.0), (1e300, 1e-300, 1.0), (1.0, 1e300, 1e-300),
                            (1e300, 1e300, 1e-300), (0.0, 1.0, 1.0)):
        gov = ThreadGovernor(2, warmup=0, window=3, hold=5, max_hold=400)
        for _ in range(60):
            gov.record(one if gov.threads() == 1 else full, work=work)
        assert gov.events and all(1 <= e["hold"] <= 400 for e in gov.events), (one, full)
        assert 1 <= gov.left <= 400
    for cost in (1e308, float("inf"), float("nan")):
        sig = FakeSignal(cost=cost)
        sig.now = 2                                              # busy: skipped probes
        gov = ThreadGovernor(2, warmup=0, window=3, hold=5, max_hold=400, signal=sig)
        used = drive_loaded(gov, sig, lambda u: 2, lambda n, u: 1e-3, 200)
        assert set(used) == {1} and gov.events, cost
        assert all(e["action"] == "skipped" and 5 <= e["hold"] <= 400 for e in gov.events)


def test_start_auto_begins_at_the_full_count_only_where_the_signal_shows_room():
    fast2 = lambda n, u: 1.0 if n == 2 else 1.8                          # noqa: E731
    kw = dict(warmup=3, window=4, hold=10, start="auto")
    # idle: the warm-up and the first window at 2 threads, a probe of one, 2 kept
    sig = FakeSignal()
    gov = ThreadGovernor(2, signal=sig, **kw)
    assert gov.threads() == 2 and gov.summary()["started"] == "full" and sig.samples == 3
    used = drive_loaded(gov, sig, lambda u: 0, fast2, 60)
    assert used[:7] == [2] * 7 and 1 in used[7:12]
    assert gov.events[0]["by"] == "timing" and gov.events[0]["threads"] == 2
    # busy when built (the median of three samples), or no signal: one thread, as start="one"
    for readings in ([2, 2, 2], [0, 2, 2]):
        sig = FakeSignal()
        it = iter(readings + [2] * 100)
        sig.sample = lambda it=it: next(it)
        gov = ThreadGovernor(2, signal=sig, **kw)
        assert gov.threads() == 1 and gov.summary()["started"] == "one", readings
    assert ThreadGovernor(2, **kw).threads() == 1
    assert ThreadGovernor(1, signal=FakeSignal(), **kw).threads() == 1
    # a competitor that arrives during the warm-up at 2 threads: dropped at the second busy
    # sample, as in a hold
    sig = FakeSignal()
    gov = ThreadGovernor(2, signal=sig, warmup=5, window=4, hold=10, start="auto")
    used = drive_loaded(gov, sig, lambda u: 0 if u < 1 else 2, lambda n, u: 1.0, 20)
    assert used[:3] == [2, 2, 2] and used[3:] == [1] * 17
    assert gov.events[0]["action"] == "dropped" and gov.events[0]["unit"] == 3
    with pytest.raises(ValueError, match="start"):
        ThreadGovernor(2, start="full")


def test_many_cores_beside_a_few_busy_threads_run_on_the_free_ones():
    """16 cores, the full count 16: one other runnable thread leaves room for 15, which the
    probe times against one thread and keeps (the work scales), where "no room" used to mean
    one thread. 15 busy threads leave one CPU: no probe, one thread, as on 2 cores."""
    scales = lambda n, u: 16.0 / n                                       # noqa: E731
    applied = []
    sig = FakeSignal(cores=16)
    gov = ThreadGovernor(16, warmup=2, window=3, hold=10, signal=sig, apply=applied.append)
    used = drive_loaded(gov, sig, lambda u: 1, scales, 80)
    assert 16 not in used and used[-40:] == [15] * 40
    assert gov.resizes == {"narrowed": 1, "widened": 0}
    assert gov.last_resize["threads"] == 15 and gov.last_resize["before"] == 16
    assert gov.last_resize["others"] == 1 and gov.last_resize["unit"] == 5
    assert all(e["by"] == "timing" for e in gov.events)          # resizes are not events
    assert gov.events[0]["threads"] == 15 and gov.events[0]["full"] == 16
    summary = gov.summary()
    assert summary["wide"] == 15 and summary["narrowed"] == 1 and summary["widened"] == 0
    assert applied == [15] and used[:5] == [1] * 5 and used[5] == 15  # warm-up, window, probe
    assert gov.threads() == gov.wide == 15 and gov.full == 16
    sig = FakeSignal(cores=16)
    gov = ThreadGovernor(16, warmup=2, window=3, hold=10, signal=sig)
    assert set(drive_loaded(gov, sig, lambda u: 15, scales, 80)) == {1}
    # 14 busy: room for 2
    sig = FakeSignal(cores=16)
    gov = ThreadGovernor(16, warmup=2, window=3, hold=10, signal=sig)
    assert drive_loaded(gov, sig, lambda u: 14, scales, 80)[-20:] == [2] * 20


def test_the_wide_count_follows_the_room_narrowing_and_widening():
    """At the wide count: two samples with less room narrow it to the room (one sample is a
    blip), two with no room for two threads drop to one, and after a narrowing two samples
    with room for two threads more (or the full count) widen it again, up to the full count;
    each change is counted, applied at once, and the unit it lands on is not timed. A
    competitor that moves by one thread narrows the team once and does not flap it."""
    scales = lambda n, u: 16.0 / n                                       # noqa: E731
    applied = []
    sig = FakeSignal(cores=16)
    gov = ThreadGovernor(16, warmup=0, window=3, hold=1000, max_hold=1000, signal=sig,
                         apply=applied.append)
    load = lambda u: {100: 6}.get(u, 0 if u < 150 else 4 if u < 250 else 0)    # noqa: E731
    used = drive_loaded(gov, sig, load, scales, 300)
    assert used[20:150] == [16] * 130                            # the blip at 100: kept
    assert used[152:250] == [12] * 98                            # narrowed at the second sample
    assert used[252:] == [16] * 48                               # widened again
    assert gov.resizes == {"narrowed": 1, "widened": 1}
    assert gov.last_resize["action"] == "widened" and gov.last_resize["unit"] == 252
    assert applied[-2:] == [12, 16]
    assert not [e for e in gov.events if e["by"] == "signal"]
    # others flapping between 1 and 2 (room 15 / 14) for hundreds of samples: one narrowing
    sig = FakeSignal(cores=16)
    gov = ThreadGovernor(16, warmup=0, window=3, hold=1000, max_hold=1000, signal=sig)
    used = drive_loaded(gov, sig, lambda u: 0 if u < 20 else 1 + (u // 2) % 2, scales, 600)
    assert gov.resizes == {"narrowed": 2, "widened": 0}          # 16 -> 15 -> 14, then held
    assert set(used[100:]) == {14}
    # a competitor that fills all but one CPU: dropped to one thread, as on 2 cores
    sig = FakeSignal(cores=16)
    gov = ThreadGovernor(16, warmup=0, window=3, hold=1000, max_hold=1000, signal=sig)
    used = drive_loaded(gov, sig, lambda u: 0 if u < 50 else 15, scales, 100)
    assert used[20:50] == [16] * 30 and used[52:] == [1] * 48
    assert [e["action"] for e in gov.events if e["by"] == "signal"][0] == "dropped"
    # no signal: the full count, whatever the load
    gov = ThreadGovernor(16, warmup=0, window=3, hold=1000)
    assert drive(gov, scales, 60)[-30:] == [16] * 30


def test_start_auto_on_many_cores_starts_on_the_room():
    sig = FakeSignal(cores=16)
    sig.now = 6
    gov = ThreadGovernor(16, signal=sig, warmup=3, window=4, hold=10, start="auto")
    assert gov.threads() == 10 and gov.summary()["started"] == "full"
    sig.now = 15
    assert ThreadGovernor(16, signal=sig, warmup=3, window=4, hold=10,
                          start="auto").threads() == 1


def test_the_ops_governors_start_at_the_full_count_on_an_idle_machine(monkeypatch):
    """An entry point called a few times per run (the classifier, evaluation) runs at the full
    count from its first call where the run queue shows room, at one thread where it does not."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    for others, want in ((0, 2), (2, 1)):
        sig = FakeSignal(cores=2)
        sig.now = others
        monkeypatch.setitem(nthreads._run_queue, "rq", sig)
        monkeypatch.setattr(cpu, "_governors", {})
        assert cpu.governor("rel_sqdist").threads() == want, others


def test_an_op_call_capped_by_its_work_feeds_the_governors_wide_side(monkeypatch):
    """_run with calls whose work caps them below the governor's wide count (4 threads' work,
    16 threads): the calls are units of the wide side, so the governor warms up, probes and
    decides, and drops to one thread when other processes fill the CPUs. Before, each was a
    unit at "another count" and dropped: the governor (started wide) never left its warm-up
    and the calls ran at 4 threads beside 15 busy CPUs for good."""
    import types
    monkeypatch.setenv("NNKLOSS_GOVERN_THREADS", "1")
    monkeypatch.setattr(torch, "get_num_threads", lambda: 16)
    sig = FakeSignal(cores=16)
    monkeypatch.setitem(nthreads._run_queue, "rq", sig)
    monkeypatch.setattr(cpu, "_governors", {})
    clock = [0.0]
    monkeypatch.setattr(cpu, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    ran = []

    def call(n):                                     # a fake clock: the work scales to 4
        clock[0] += 1.0 / n
        ran.append(n)
        return 0

    work = 4 * cpu.PARALLEL_MIN_ELEMS
    assert cpu._threads(work) == 4
    for u in range(300):
        sig.now = 0 if u < 200 else 15
        cpu._run("forward", work, call)
    gov = cpu._governors["forward"]
    timing = [e for e in gov.events if e["by"] == "timing"]
    assert timing and timing[0]["unit"] < 200 and timing[0]["threads"] == 16
    assert set(ran[:200]) == {1, 4} and ran[100:200].count(4) >= 95  # capped; probes of 1
    assert [e["action"] for e in gov.events if e["by"] == "signal"][0] == "dropped"
    assert ran[205:] == [1] * 95 and gov.threads() == 1


# ------------------------------------------------------------------ the search's governors
class _OneThread:
    """A governor that has chosen one thread (records nothing)."""

    def threads(self):
        return 1


@pytest.mark.skipif(not cpu.available(), reason="compiled CPU kernel unavailable")
def test_the_searchs_gemm_and_selection_are_governed(monkeypatch):
    """A CPU search feeds the "gemm" and "knn_select" governors (its distance tiles and their
    folds into the selections), which decide its threads as the op's decide the op's; the
    lists are the same governed or not."""
    from nnkloss.bank.search import knn
    monkeypatch.setenv("NNKLOSS_GOVERN_THREADS", "1")  # conftest turns the governors off
    monkeypatch.setattr(cpu, "_governors", {})
    monkeypatch.setattr(cpu, "GEMM_MIN_MACS", 1)
    monkeypatch.setattr(cpu, "PARALLEL_MIN_ELEMS", 1)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    x = torch.randn(3000, 16, generator=torch.Generator().manual_seed(0))
    governed = knn(x, x, 20, exclude_self=True, tile_bytes=1 << 20)
    assert cpu._governors["gemm"].units > 0 and cpu._governors["knn_select"].units > 0
    monkeypatch.setenv("NNKLOSS_GOVERN_THREADS", "0")
    fixed = knn(x, x, 20, exclude_self=True, tile_bytes=1 << 20)
    assert torch.equal(governed.neighbours, fixed.neighbours)
    assert torch.equal(governed.distances, fixed.distances)


def test_governing_follows_the_variable_as_the_process_changes_it(monkeypatch):
    """cpu.governing() reads NNKLOSS_GOVERN_THREADS at every call (from os.environ's own
    mapping, not through os.environ.get: 4.6 us a read after a kernel), so a change within the
    process, as monkeypatch and the benchmarks make it, takes effect at the next call: only
    "0" turns the governors off."""
    for value, on in (("0", False), ("1", True), ("", True), ("00", True), (None, True)):
        if value is None:
            monkeypatch.delenv("NNKLOSS_GOVERN_THREADS", raising=False)
        else:
            monkeypatch.setenv("NNKLOSS_GOVERN_THREADS", value)
        assert cpu.governing() is on, value
    os.environ["NNKLOSS_GOVERN_THREADS"] = "0"  # os.environ itself, as bench_threads sets it
    assert cpu.governing() is False


@pytest.mark.skipif(not cpu.available(), reason="compiled CPU kernel unavailable")
def test_gemm_nt_with_a_thread_count_bypasses_its_governor(monkeypatch):
    """gemm_nt(..., nthreads): exactly that count (a benchmark's rate of the machine), never
    the governor's choice of the moment; without it, the governor's."""
    monkeypatch.setenv("NNKLOSS_GOVERN_THREADS", "1")
    a, b = torch.randn(64, 24), torch.randn(96, 24)
    out = torch.empty(64, 96)
    seen = []
    monkeypatch.setattr(cpu, "_run", lambda name, work, call, m=None: seen.append(name) or call(1))
    if not cpu.gemm_nt(a, b, out, 2):
        pytest.skip("the library's GEMM needs AVX-512")
    assert seen == [] and torch.allclose(out, a @ b.t(), atol=1e-4)
    assert cpu.gemm_nt(a, b, out) and seen == ["gemm"]


def _following_counts(monkeypatch, items=3, stop=None):
    """torch's thread count (and the library's full count) seen inside each item of
    iter_following, with torch at 2 threads and the governor at one; then torch's count."""
    torch.set_num_threads(2)
    monkeypatch.setattr(cpu, "governor", lambda name: _OneThread())
    seen = []
    for i, _ in enumerate(cpu.iter_following(range(items), "knn_select")):
        seen.append((torch.get_num_threads(), cpu.full_threads()))
        if i == stop:
            break
    return seen, torch.get_num_threads()


def test_iter_following_lowers_torchs_threads_within_each_item_only(monkeypatch):
    """Within each item torch runs at the governor's count (one) while the library's calls
    keep the full count (2); between items, after the last one, after a break and after an
    exception in the caller, torch's count is back."""
    monkeypatch.setenv("NNKLOSS_GOVERN_THREADS", "1")
    old = torch.get_num_threads()
    try:
        seen, after = _following_counts(monkeypatch)
        assert seen == [(1, 2)] * 3 and after == 2
        seen, after = _following_counts(monkeypatch, stop=0)
        assert seen == [(1, 2)] and after == 2 and cpu.full_threads() == 2
        gen = cpu.iter_following(range(3), "knn_select")
        with pytest.raises(RuntimeError):
            for _ in gen:
                assert torch.get_num_threads() == 1
                raise RuntimeError("the caller's work failed")
        gen.close()
        assert torch.get_num_threads() == 2 and cpu.full_threads() == 2
    finally:
        torch.set_num_threads(old)


def test_iter_following_leaves_torch_alone_off_the_main_thread_and_ungoverned(monkeypatch):
    """torch's count is the process's: a background thread's search (the refresher's) does
    not lower it under the training loop; nor does anything with NNKLOSS_GOVERN_THREADS=0."""
    import threading
    monkeypatch.setenv("NNKLOSS_GOVERN_THREADS", "1")
    old = torch.get_num_threads()
    try:
        out = {}
        worker = threading.Thread(target=lambda: out.update(r=_following_counts(monkeypatch)))
        worker.start()
        worker.join(timeout=60)
        assert out["r"] == ([(2, 2)] * 3, 2)
        monkeypatch.setenv("NNKLOSS_GOVERN_THREADS", "0")
        assert _following_counts(monkeypatch) == ([(2, 2)] * 3, 2)
    finally:
        torch.set_num_threads(old)


@pytest.mark.skipif(not cpu.available(), reason="compiled CPU kernel unavailable")
def test_evaluate_works_on_each_block_at_the_governed_count(monkeypatch):
    """evaluate's metrics on each block of the CPU search run inside iter_following: at one
    thread where the selection's governor chose one."""
    from nnkloss.evaluation import metrics
    monkeypatch.setenv("NNKLOSS_GOVERN_THREADS", "1")
    old = torch.get_num_threads()
    seen = []
    cumsum = torch.cumsum
    monkeypatch.setattr(torch, "cumsum", lambda *a, **k: seen.append(
        torch.get_num_threads()) or cumsum(*a, **k))
    try:
        torch.set_num_threads(2)
        monkeypatch.setattr(cpu, "governor", lambda name: _OneThread())
        x = torch.randn(400, 8, generator=torch.Generator().manual_seed(1))
        metrics.evaluate(x, torch.arange(400) % 4, (1,), tile_bytes=1 << 18)
    finally:
        torch.set_num_threads(old)
    assert len(seen) > 1 and set(seen) == {1}


def test_a_search_without_the_library_leaves_torchs_threads_as_they_are(monkeypatch):
    """Without the compiled library no governor of the search is ever fed (its first choice
    would hold for the process): the torch search runs at torch's count."""
    from nnkloss.bank.search import knn
    monkeypatch.setenv("NNKLOSS_GOVERN_THREADS", "1")
    monkeypatch.setattr(cpu, "available", lambda: False)
    monkeypatch.setattr(cpu, "iter_following", lambda *a: pytest.fail("followed"))
    x = torch.randn(300, 8, generator=torch.Generator().manual_seed(2))
    assert knn(x, x, 5, exclude_self=True).neighbours.shape == (300, 5)
