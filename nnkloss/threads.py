"""A thread-count governor: time the work at the full thread count and at one thread, keep the
faster, and look again later (issue 21).

Why measure rather than guess: on the 2-core machine this package is developed on, torch's
default of 2 threads made the digits demo 1.4x faster than one thread when the machine was idle
and 1.6x to 4.8x *slower* beside other processes (an OpenMP team's barrier waits for its
slowest, descheduled, thread; benchmarks/results/threads_AMD_EPYC_2026-11-23.txt). Which one
wins depends on what else runs, which changes while a job runs, so a fixed default is wrong
somewhere. :class:`ThreadGovernor` is a small state machine fed with the duration of each unit
of work (a training step, a kernel call):

1. ``warmup`` units at one thread, not timed (allocations, first-call costs). It starts at
   one thread because that is the cheap mistake: idle, one thread costs 1.4-1.8x on 2 cores;
   beside a busy process, two threads cost up to 5x (measured, see above). With
   ``start="auto"`` and a signal (below) that shows room for the full count, it starts at the
   full count instead: an entry point called a few times per run (an evaluation, the kernel
   classifier) would otherwise spend all its calls at one thread on an idle machine (measured:
   the classifier's first calls 25-46 ms against 13-19 ms at two threads);
2. a probe: ``window`` units at the current choice (free: that is what runs anyway), then up
   to ``window`` at the other count (the first unit after each switch is not timed: an OpenMP
   team that changes size pays once). The other side is abandoned as soon as one of its units
   costs more than ``2 * abandon`` times the current side's median per unit of work, or two
   of them have a median above ``abandon`` times it, so a probe of a far worse count costs two
   units and of a clearly worse one three. The full count is kept only if it is cheaper than
   one thread by more than ``margin`` (a fraction): ties go to one thread, because a wrong
   "one" costs at most the thread count while a wrong "full" beside a busy process cost 27x
   per training step on 2 cores (measured: 0.7-0.9 s against 26-36 ms, digits demo beside a
   2-thread matmul);
3. a hold of ``hold`` units, after which it probes again. When a probe confirms the previous
   choice the hold doubles (up to ``max_hold``); when it changes the choice it drops back to
   ``hold``. The hold is never shorter than what keeps the probes within ``probe_budget`` of
   the time (a probe that ran u units at a count r times slower than the winner cost
   u (r - 1) units more: the hold is at least that over ``probe_budget``, up to ``max_hold``).
   So a steady machine is probed rarely, an expensive probe is repeated late, and a machine
   whose load changes is followed within a hold.

Timing alone has two costs beside a busy process: the first probe of each run still runs a
few units at the full count (each tens of one-thread units there), and a probe that falls in a
pause of the other process can pick the full count for a whole hold. So where it means
something (:func:`run_queue_unavailable`: Linux, the machine's CPUs are ours, no cgroup quota)
the governor also reads a ``signal``: the runnable threads of *other* processes
(:class:`RunQueue`: /proc/loadavg's runnable tasks less this process's threads in state R;
40-130 us a read on the 2-core VM, idle to beside a busy 2-thread process). With ``cores`` CPUs
and ``others`` runnable threads elsewhere, the full count (at most ``cores``) has no room when
``cores - others < full``: some of its threads would share a CPU, and an OpenMP barrier then
waits for the descheduled one (measured on 2 cores, a digits CNN training step beside one
spinning thread: 2 threads 1.5x slower than 1 at the median, 2.7x on average). Then:

4. before a probe of the full count (at one thread, at the end of the probe's window), the
   median of the last ``signal_samples`` samples (those of the window and a fresh one) decides:
   no room, no probe; the governor stays at one thread and looks again after ``hold`` units
   (the base hold, not the back-off one: a competitor that leaves is noticed within a hold),
   or after more where the units are so short that the probe's samples would cost more than
   ``sample_budget`` of the time (below);
5. at the full count (holding or probing), two consecutive samples with no room drop to one
   thread at once (a probe in progress ends there) and start a hold of ``hold`` units.

"No room" means fewer than two free CPUs. Where the others leave some, but fewer than the
full count, the wide side runs on the free ones: ``cores - others`` threads, each on a CPU
of its own (the "room"; the count is never above the full count). So a 16-core machine with one
busy thread elsewhere runs 15 threads, not one, and a 2-core machine beside any busy thread
runs one, as before. Before a probe the median's room sets the wide count; at the wide count
two consecutive samples with less room than it uses narrow it (down to one thread, as in 5,
where fewer than two CPUs are free), and two with room for at least two more threads than it
uses (or for the full count), after a narrowing, widen it again (up to the full count; the
margin keeps a competitor that moves by one thread from resizing the team back and forth).
A narrowing or widening during a probe restarts that side's window (its timings were of
another count). They are counted (``resizes``, in :meth:`ThreadGovernor.summary`) and the
last one kept (``last_resize``), not added to ``events``: a run queue that moves all the time
would grow that list without bound.

The samples are spaced so that they cost at most ``sample_budget`` of the recorded time (every
unit for training steps; every few calls for the op), plus one per probe decision; a hold after
a skipped probe lasts long enough to keep that one within the budget too. On an idle
machine the signal finds room and the probes decide by timing, as without it. Decisions of the
signal are ``events`` with ``by="signal"`` and ``action`` "skipped" (a probe) or "dropped" (the
full count); those of timing have ``by="timing"``. Without a signal (elsewhere, or after a read
error) the governor times alone.

Every decision is kept in ``events`` (unit index, both medians, the choice) and summarised by
:meth:`ThreadGovernor.summary`; nothing is printed. The clock is the caller's (the durations
passed to :meth:`ThreadGovernor.record`) and the signal a parameter, so the tests drive both
with fakes. The governor only chooses a number; who applies it is the caller's business
(``apply`` is called with the new count at each change: the Trainer passes
``torch.set_num_threads``; the CPU op reads :meth:`threads` before each call).
"""
from __future__ import annotations

import operator
import os
import sys
import threading
import time
from typing import Callable, Dict, List, Optional

__all__ = ["ThreadGovernor", "RunQueue", "run_queue", "run_queue_unavailable"]

_INF = float("inf")


# ------------------------------------------------------------------ other processes' demand
# Timing a whole unit at each count is the only direct measure of which count is faster, but
# beside a busy process one unit at the full count costs tens of units at one thread (measured:
# 27x per training step on 2 cores beside a 2-thread matmul), and a probe that happens to fall
# in a pause of the other process picks the full count for a whole hold. The kernel already
# knows how many threads want a CPU now: /proc/loadavg's fourth field ("running/total") counts
# the runnable scheduling entities of the machine (running or waiting for a CPU). Less this
# process's own runnable threads (its spinning OpenMP workers included) that is the demand of
# everyone else, read in tens of microseconds.

def parse_loadavg_running(text) -> int:
    """The number of runnable tasks in /proc/loadavg's text ("0.84 0.66 0.82 4/90 22517": 4)."""
    if isinstance(text, bytes):
        text = text.decode("ascii", "replace")
    running = int(text.split()[3].split("/")[0])
    if running < 0:
        raise ValueError(f"negative run queue in {text!r}")
    return running


def parse_task_state(text) -> str:
    """The state letter of a /proc/<pid>/task/<tid>/stat line ("R" = runnable). The field
    after the command name, which is parenthesised and may itself hold spaces and ')': split
    at the last ')'."""
    if isinstance(text, bytes):
        text = text.decode("ascii", "replace")
    end = text.rindex(")")
    state = text[end + 1:].split(None, 1)[0]
    if len(state) != 1:
        raise ValueError(f"no state after the command name in {text!r}")
    return state


def _read(path: str, size: int = 4096) -> bytes:
    fd = os.open(path, os.O_RDONLY)  # os.open/os.read: half the cost of open() for /proc
    try:
        return os.read(fd, size)
    finally:
        os.close(fd)


def _cgroup_quota_files(root: str, cgroup_text: str) -> List[str]:
    """The files that would hold a CPU quota for this process: cgroup v2 ``cpu.max`` and v1
    ``cpu.cfs_quota_us``, at the hierarchy's root, at this process's own cgroup (the paths of
    /proc/self/cgroup) and at every cgroup between them: a quota on a parent (a systemd slice,
    a job's cgroup above its steps) limits its children as much as their own."""
    files = [os.path.join(root, "cpu.max")]
    v1_dirs = ["cpu", "cpu,cpuacct", "cpuacct,cpu"]
    files += [os.path.join(root, d, "cpu.cfs_quota_us") for d in v1_dirs]
    for line in cgroup_text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        segments = [p for p in path.strip().split("/") if p]
        for depth in range(len(segments), 0, -1):  # own cgroup first, then each parent
            rel = os.path.join(*segments[:depth])
            if controllers == "":  # v2: "0::/path"
                files.append(os.path.join(root, rel, "cpu.max"))
            elif "cpu" in controllers.split(","):
                files += [os.path.join(root, d, rel, "cpu.cfs_quota_us") for d in v1_dirs]
    return files


def _quota_limits(path: str, text: str) -> bool:
    if path.endswith("cpu.max"):          # "max 100000" or "150000 100000"
        return text.split()[0] != "max"
    return int(text.split()[0]) > 0        # cpu.cfs_quota_us: -1 = no quota


def run_queue_unavailable(*, platform: Optional[str] = None, proc: str = "/proc",
                          cgroup_root: str = "/sys/fs/cgroup",
                          cpu_count: Optional[Callable[[], Optional[int]]] = None,
                          affinity: Optional[Callable[[], int]] = None) -> Optional[str]:
    """Why /proc/loadavg's run queue does not describe the CPUs this process may use (a
    sentence), or None when it does: Linux with /proc, the kernel's CPU count equal to the
    CPUs of our affinity mask, and no cgroup CPU quota. In a container on a bigger host, or
    pinned to a few of the host's CPUs, the run queue counts tasks that never compete with us.
    The arguments stand in for the real system in tests."""
    platform = sys.platform if platform is None else platform
    if not platform.startswith("linux"):
        return f"not Linux ({platform})"
    try:
        ncpu = (os.cpu_count if cpu_count is None else cpu_count)()
        if affinity is None:
            if not hasattr(os, "sched_getaffinity"):
                return "no os.sched_getaffinity"
            mine = len(os.sched_getaffinity(0))
        else:
            mine = affinity()
    except OSError as exc:
        return f"CPU count unreadable: {exc}"
    if not ncpu or ncpu != mine:
        return f"the machine has {ncpu} CPUs, this process may use {mine}"
    try:
        parse_loadavg_running(_read(os.path.join(proc, "loadavg")))
        parse_task_state(_read(os.path.join(proc, "self", "stat")))
        os.listdir(os.path.join(proc, "self", "task"))
    except (OSError, ValueError, IndexError) as exc:
        return f"/proc unreadable: {exc}"
    try:
        cgroups = _read(os.path.join(proc, "self", "cgroup"), 1 << 16).decode("utf-8", "replace")
    except OSError:
        cgroups = ""
    for path in _cgroup_quota_files(cgroup_root, cgroups):
        try:
            text = _read(path, 256).decode("ascii", "replace")
        except FileNotFoundError:
            continue
        except OSError as exc:
            return f"{path} unreadable: {exc}"
        try:
            if _quota_limits(path, text):
                return f"a cgroup CPU quota ({path}: {text.strip()})"
        except (ValueError, IndexError):
            return f"{path} unparsable: {text.strip()!r}"
    return None


class RunQueue:
    """Other processes' CPU demand: the runnable tasks of the machine (/proc/loadavg) less this
    process's runnable threads (/proc/self/task/*/stat in state R).

    :meth:`sample` returns that count ("others"), or None once a read has failed (then for
    good: the governor falls back to timing alone, and nothing is raised). ``cores`` is the
    number of CPUs this process may use; ``cost`` the seconds the last sample took (the
    governor spaces its samples by it). Only meaningful where :func:`run_queue_unavailable`
    returns None; :func:`run_queue` checks that.

    Measured on the 2-core development VM (Python 3.11, a torch process with 4 threads): 43 us a
    sample back to back (/proc/loadavg ~5 us, listing the threads ~6 us, ~7 us per thread),
    ~60 us spaced out between other work, ~130 us beside a busy 2-thread process (the reader
    waits for a CPU too).
    """

    def __init__(self, cores: int, *, proc: str = "/proc",
                 clock: Callable[[], float] = time.perf_counter):
        self.cores = int(cores)
        self.proc = proc
        self.clock = clock
        self.cost = 0.0
        self.failed: Optional[str] = None
        self._loadavg = os.path.join(proc, "loadavg")
        self._tasks = os.path.join(proc, "self", "task")

    def own_running(self) -> int:
        """This process's threads in state R."""
        n = 0
        for tid in os.listdir(self._tasks):
            try:
                text = _read(os.path.join(self._tasks, tid, "stat"), 1024)
            except (FileNotFoundError, ProcessLookupError):
                continue  # the thread ended between the listing and the read
            n += parse_task_state(text) == "R"
        return n

    def sample(self) -> Optional[int]:
        if self.failed is not None:
            return None
        t0 = self.clock()
        try:
            # Our threads first, then the machine's: a worker of ours that stops spinning in
            # between is then counted by the first and not the second, which under-counts the
            # others (the safe side: timing still decides) instead of over-counting them.
            own = self.own_running()
            running = parse_loadavg_running(_read(self._loadavg, 256))
        except (OSError, ValueError, IndexError) as exc:
            self.failed = f"{type(exc).__name__}: {exc}"
            return None
        self.cost = self.clock() - t0
        return max(running - own, 0)


_run_queue_lock = threading.Lock()
_run_queue: Dict[str, Optional[RunQueue]] = {}


def run_queue() -> Optional[RunQueue]:
    """The process's shared :class:`RunQueue`, or None where the run queue does not describe
    our CPUs (:func:`run_queue_unavailable`). Checked once per process."""
    with _run_queue_lock:
        if "rq" not in _run_queue:
            try:
                why = run_queue_unavailable()
                rq = RunQueue(len(os.sched_getaffinity(0))) if why is None else None
            except Exception:  # never an exception to the user: timing alone
                rq = None
            _run_queue["rq"] = rq
        return _run_queue["rq"]


class ThreadGovernor:
    """Chooses between ``full`` threads (the wide side) and one by timing, and where it has a
    ``signal`` runs the wide side on the CPUs other processes leave free (:attr:`wide`), and
    does not probe or keep it while they leave fewer than two (see the module docstring).
    Thread-safe: :meth:`record` may be called from several threads.

    Args:
        full: the full thread count (a number, or a callable read at each probe). With
            ``full <= 1`` there is nothing to choose: 1. A callable must not read the count
            that ``apply`` sets: ``torch.get_num_threads`` with ``apply=torch.set_num_threads``
            reads 1 once one thread is applied, and the full count is lost for good (the CPU
            op's governors read :func:`nnkloss.ops.cpu.full_threads`, which their callers
            never lower; the Trainer passes a number).
        warmup, window, hold, max_hold: in units of work (see the module docstring).
        margin: the full count is kept only if its median cost is below ``(1 - margin)``
            times one thread's (ties go to one thread).
        abandon: a probed side whose median over two units exceeds this times the current
            side's (or whose first unit exceeds twice this) is given up at once.
        probe_budget: the share of the time probes may cost (it lengthens the hold after an
            expensive probe).
        apply: called with the new thread count whenever the choice changes (None: nothing).
        signal: other processes' CPU demand (see the module docstring): None (timing alone,
            the default of a governor built by hand), "auto" (:func:`run_queue`: the
            machine's run queue where it describes our CPUs, else None; the Trainer's and the
            CPU op's governors), or an object with ``cores`` (int), ``sample()`` (the others'
            runnable threads, or None when unknown) and optionally ``cost`` (seconds a sample
            takes).
        sample_budget: the share of the time samples of the signal may cost: samples are at
            least ``cost / sample_budget`` seconds of recorded work apart (every unit when the
            units are long), besides one at each decision to probe the full count (a skipped
            probe's hold is lengthened to keep it within the budget).
        signal_samples: the decision to probe the full count takes the median of this many
            samples (the last ones of the window at one thread, the freshest last), so one
            momentary reading does not decide.
        start: "one" (the default: the first units at one thread) or "auto" (at the wide
            count, the full count or the room if smaller, when the median of
            ``signal_samples`` samples of the signal, read when the governor is built, leaves
            room for more than one thread; else one thread, and always without a signal).
            Started wide, the warm-up is watched as a hold is: two samples with no room drop
            to one thread at once.
    """

    def __init__(self, full=2, *, warmup: int = 5, window: int = 6, hold: int = 64,
                 max_hold: int = 4096, margin: float = 0.05, abandon: float = 1.5,
                 probe_budget: float = 0.05, apply: Optional[Callable[[int], None]] = None,
                 signal=None, sample_budget: float = 0.01, signal_samples: int = 3,
                 start: str = "one"):
        if window < 2 or hold < 1 or max_hold < hold or warmup < 0 or not 0 < probe_budget <= 1:
            raise ValueError("need window >= 2, hold >= 1, max_hold >= hold, warmup >= 0, "
                             "0 < probe_budget <= 1")
        if not 0 < sample_budget <= 1 or signal_samples < 1:
            raise ValueError("need 0 < sample_budget <= 1 and signal_samples >= 1")
        if start not in ("one", "auto"):
            raise ValueError(f"start must be 'one' or 'auto', got {start!r}")
        self.signal = run_queue() if isinstance(signal, str) and signal == "auto" else signal
        if self.signal is not None:
            # read as int(signal.cores) at every decision: a missing or bad value raised there,
            # inside record(), instead of here
            cores = getattr(self.signal, "cores", None)
            try:
                ok = not isinstance(cores, bool) and operator.index(cores) >= 1
            except TypeError:
                ok = False
            if not ok:
                raise ValueError(f"signal.cores must be an int >= 1 (the CPUs this process may "
                                 f"use), got {cores!r}")
        self.sample_budget, self.signal_samples = float(sample_budget), int(signal_samples)
        self.probe_budget = float(probe_budget)
        self._full = full
        self.warmup, self.window, self.base_hold, self.max_hold = warmup, window, hold, max_hold
        self.margin, self.abandon = float(margin), float(abandon)
        self.apply = apply
        # Re-entrant: ``apply`` is called with the lock held (the count changes inside
        # record()), and an apply that logs summary() or calls skip_next() deadlocked.
        self._lock = threading.RLock()
        self.units = 0                   # units recorded so far
        self.events: List[Dict] = []     # one per decision
        self.hold = self.base_hold
        self.choice = None               # None until the first decision, then "one" / "full"
        self._one = True                 # running at one thread now (else at the full count)
        self._skip = False               # drop the next unit (after a switch)
        self._costs: Dict[str, List[float]] = {}
        self._elapsed = 0.0              # seconds recorded so far (the signal's clock)
        self._sampled_at = None          # _elapsed at the last sample of the signal
        self._others: List[int] = []     # this probe's samples at one thread
        self._samples = 0                # samples of the signal taken so far
        self._probe_from = (0.0, 0, 0)   # _elapsed, units, _samples when this probe began
        self._busy = 0                   # consecutive samples at the wide count, less room
        self._roomy = 0                  # consecutive samples at the wide count, more room
        self._cap: Optional[int] = None  # the wide side's count, when the room set it
        self.resizes = {"narrowed": 0, "widened": 0}
        self.last_resize: Optional[Dict] = None
        self.others: Optional[int] = None  # the last sample
        self.phase, self.left = "warmup", self.warmup
        self.started = "one"             # the count of the first units: "one" / "full"
        if start == "auto" and self.full > 1 and self._room_at_start():
            self._one, self.started = False, "full"
        if self.warmup == 0:
            self._start_probe()

    @property
    def full(self) -> int:
        f = self._full() if callable(self._full) else self._full
        return max(1, int(f))

    @property
    def wide(self) -> int:
        """The count of the wide side: the full count, or fewer where the signal's room (the
        CPUs the other processes leave free) was smaller at the last look."""
        return self.full if self._cap is None else max(1, min(self.full, self._cap))

    def threads(self) -> int:
        """The thread count for the next unit of work (the full count is read afresh)."""
        return 1 if self._one else self.wide

    def _set(self, one: bool):
        if one != self._one:
            self._one = one
            self._skip = True
            self._busy = self._roomy = 0
            if self.apply is not None:
                self.apply(self.threads())

    def _resize(self, room: int, others: int) -> bool:
        """Set the wide side's count to the ``room`` (at most the full count), at the wide
        side or before a probe of it: counted in ``resizes`` and kept as ``last_resize`` when
        the count changes; at the wide side the count is applied, the next unit is not timed
        and a probe's window there starts again (its timings were of another count). True
        when the running count changed."""
        before = self.wide
        self._cap = int(room)
        self._busy = self._roomy = 0
        if self.wide == before:
            return False
        action = "narrowed" if self.wide < before else "widened"
        self.resizes[action] += 1
        self.last_resize = {"unit": self.units, "action": action, "threads": self.wide,
                            "before": before, "others": others, "cores": int(self.signal.cores)}
        if self._one:
            return False
        self._wide_changed()
        return True

    def _wide_changed(self) -> None:
        """The wide side's count changed while it runs: applied, the next unit is not timed
        (an OpenMP team that changes size pays once), and a probe's costs and window there
        start again (its timings were of another count)."""
        self._skip = True
        self._costs.pop("full", None)
        if self.phase in ("current", "other"):
            self.left = self.window
        if self.apply is not None:
            self.apply(self.threads())

    # -------------------------------------------------------------- the signal
    def _sample(self, force: bool = False) -> Optional[int]:
        """A sample of the others' demand, or None (no signal, not due yet, or unknown). Samples
        are spaced by ``cost / sample_budget`` seconds of recorded work unless ``force``."""
        sig = self.signal
        if sig is None:
            return None
        if not force and self._sampled_at is not None:
            gap = float(getattr(sig, "cost", 0.0) or 0.0) / self.sample_budget
            if self._elapsed - self._sampled_at < gap:
                return None
        self._sampled_at = self._elapsed
        self._samples += 1
        try:
            others = sig.sample()
            if others is not None:
                # A count, taken here where a failure is caught: a NaN, inf or text reading
                # raised from int() inside record(). Below 0 it is 0 (the RunQueue clamps
                # its own race so): a negative count made room for more CPUs than there are.
                others = max(int(others), 0)
        except Exception:  # a signal that fails is no signal: timing alone, never an error
            self._drop_signal()
            return None
        if others is None and getattr(sig, "failed", None):
            self._drop_signal()  # a RunQueue whose read failed stays failed
        if others is not None:
            self.others = others
        return others

    def _drop_signal(self) -> None:
        """No signal from here on: timing alone, between the full count and one thread. The
        room of the last samples no longer describes the machine: kept, it capped the wide
        side at that room for good (12 of 16 threads after others of 4, whatever came after).
        At the wide side the full count is applied, as a resize's is (the next unit is not
        timed, a probe's window there starts again)."""
        self.signal = None
        if self._cap is None:
            return
        before = self.wide
        self._cap = None
        if not self._one and self.wide != before:
            self._wide_changed()

    def _room_at_start(self) -> bool:
        """Whether the median of ``signal_samples`` fresh samples leaves room for more than one
        thread (False without a signal, or when a sample is unknown); the wide count is then
        the room."""
        samples = [self._sample(force=True) for _ in range(self.signal_samples)]
        if self.signal is None or any(s is None for s in samples):
            return False
        others = self._median(samples)
        if self._no_room(others):
            return False
        self._cap = self._room(others)
        return True

    def _room(self, others: Optional[int]) -> Optional[int]:
        """The CPUs that ``others`` runnable threads of other processes leave free (None
        without a signal or a sample)."""
        if others is None or self.signal is None:
            return None
        return int(self.signal.cores) - int(others)

    def _no_room(self, others: Optional[int]) -> bool:
        """Whether ``others`` runnable threads of other processes leave fewer than two CPUs
        free: more than one thread would then share a CPU with them (where the room holds
        more, the wide side runs on it; see the module docstring)."""
        room = self._room(others)
        return room is not None and room < 2

    def _side(self) -> str:
        return "one" if self._one else "full"

    def record(self, seconds: float, work: float = 1.0, threads: Optional[int] = None) -> None:
        """One unit of work took ``seconds`` (``work``: its size, so that units of different
        sizes compare per unit of work). ``threads``: the count it ran at, when the caller
        knows it; a unit that ran at another count than the governor's is not timed.
        ``seconds`` must be finite and >= 0, ``work`` finite and > 0 (ValueError)."""
        # Checked here, not where they are used: a NaN or infinite duration (or a cost
        # seconds / 0) reached the medians and the hold's arithmetic, and record() raised
        # "cannot convert float NaN to integer" units later; a negative one made its side
        # look faster than free and chose it.
        seconds, work = float(seconds), float(work)
        if not 0.0 <= seconds < _INF:  # False for NaN too
            raise ValueError(f"seconds must be a finite duration >= 0, got {seconds!r}")
        if not 0.0 < work < _INF:
            raise ValueError(f"work must be finite and > 0, got {work!r}")
        with self._lock:
            self.units += 1
            self._elapsed += seconds
            if (self.phase == "hold" and self._one and self.left > 1 and not self._skip
                    and (threads is None or threads == 1)):
                # The steady state beside a busy process (and of one thread idle): a unit of a
                # hold at one thread only counts down. The full path below does the same, after
                # reading the full count and the signal's state: the op's calls follow a kernel
                # that swept the caches, and there each Python step costs microseconds (the
                # governed call 15 us above the ungoverned one, measured on the 2-core Intel
                # Xeon; the default 1.2-2.2% slower than one thread beside a 2-thread matmul).
                # One difference: where the full count is 1 (nothing to choose) the full path
                # stops counting down, this one counts down to 1, so a probe comes one unit
                # after the full count grows again rather than after the hold's remainder.
                self.left -= 1
                return
            if threads is not None and threads != self.threads():
                return
            full = self.full  # read once: a callable full count costs a call per read
            # watched from the first unit at the full count (start="auto"), else after the
            # warm-up
            if (self.signal is not None and full > 1
                    and (self.phase != "warmup" or not self._one)):
                if self._watch():
                    return
            if self._skip:
                self._skip = False
                return
            if full <= 1:
                return
            self.left -= 1
            if self.phase in ("current", "other"):
                cost = seconds / work
                self._costs.setdefault(self._side(), []).append(cost)
                if self.phase == "other" and self._clearly_worse():
                    return self._decide()
            if self.left > 0:
                return
            if self.phase in ("warmup", "hold"):
                self._start_probe()
            elif self.phase == "current":
                if self._one and self._skip_probe():
                    return
                self.phase, self.left = "other", self.window
                self._set(not self._one)
            else:
                self._decide()

    def _watch(self) -> bool:
        """Samples the signal where it can change a decision; returns True when it changed the
        running count (the unit just recorded is then not timed). At the wide count (holding or
        probing): two consecutive samples with no room for more than one thread drop to one
        at once, which ends any probe and starts a normal hold (one sample could be a moment's
        burst); two with room for fewer threads than run, but at least two, narrow the count
        to the room, and two with room for more, after a narrowing, widen it (up to the full
        count). At one thread, in a probe's window before the wide count: the samples the
        decision to probe it will take."""
        if not self._one:
            cap = self._cap
            others = self._sample()
            if others is None:
                # the signal lost just now and the room's cap with it: the count changed
                # where the cap was below the full count (_drop_signal applied the full one)
                return cap is not None and self._cap is None and cap < self.full
            room = self._room(others)
            wide = self.wide
            less = room < wide
            more = (self._cap is not None and wide < self.full
                    and room >= min(self.full, wide + 2))
            self._busy = self._busy + 1 if less else 0
            self._roomy = self._roomy + 1 if more else 0
            if self._busy >= 2:
                if not self._no_room(others):  # fewer CPUs free than it uses: run on those
                    return self._resize(room, others)
                self._signal_event("dropped", others, self.base_hold)
                self.hold = self.base_hold
                self._set(True)
                return True
            if self._roomy >= 2:  # CPUs freed since a narrowing: take them back
                return self._resize(room, others)
        elif self.phase == "current":
            others = self._sample()
            if others is not None:
                self._others.append(others)
        return False

    def _skip_probe(self) -> bool:
        """At one thread, at the end of a probe's window: skip the probe of the full count when
        the median of the last samples (a fresh one included) leaves it no room; look again
        after a base hold (not the back-off hold: a competitor that leaves is noticed within
        ``hold`` units), or a longer one where the units are short (:meth:`_skip_hold`). The
        back-off of timing decisions is left as it was."""
        fresh = self._sample(force=True)
        if fresh is None:
            return False  # no signal now: timing decides, as without one
        recent = (self._others + [fresh])[-self.signal_samples:]
        others = self._median(recent)
        if not self._no_room(others):
            self._resize(self._room(others), others)  # the probe's wide count: the room now
            return False
        self._signal_event("skipped", others, self._skip_hold())
        return True

    def _skip_hold(self) -> int:
        """The hold after a skipped probe: the base hold, or as many units as keep this probe's
        samples (its window's and the forced one) within ``sample_budget`` of the time from
        the probe's start to the next one. Beside a busy process the governor skips a probe
        every base hold, and a forced sample there is not spaced by its cost: with units of
        0.25 ms and samples of 130 us (a read beside a busy 2-thread process on the 2-core VM)
        the base hold of 50 units spent 1.9% of the time on samples, 0.95% at 0.5 ms
        (counted with a fake signal, ``tests/test_threads.py``); a competitor that leaves is
        then noticed within ``cost / sample_budget`` seconds per sample (26 ms there) rather
        than within 50 units."""
        elapsed, units, samples = self._probe_from
        cost = float(getattr(self.signal, "cost", 0.0) or 0.0)
        n = self.units - units
        span = self._elapsed - elapsed
        if not (cost > 0.0 and n > 0 and span > 0.0):  # "not >": a NaN cost or span too
            return self.base_hold
        need = (self._samples - samples) * cost / self.sample_budget  # seconds of work
        after = need * n / span - n  # units after the window's n
        # A huge cost (or a span of ~0 s) overflows to inf, whose int() raised: capped first.
        if after >= self.max_hold:
            return self.max_hold
        return max(self.base_hold, int(-(-after // 1)))

    def _signal_event(self, action: str, others: int, hold: int):
        cost_one = self._median(self._costs.get("one"))
        cost_full = self._median(self._costs.get("full"))
        if self.choice is None or action == "dropped":
            self.choice = "one"
        self.events.append({"unit": self.units, "full": self.full, "cost_full": cost_full,
                            "cost_one": cost_one, "threads": 1, "hold": hold,
                            "by": "signal", "action": action, "others": others,
                            "cores": int(self.signal.cores)})
        self.phase, self.left = "hold", hold

    def skip_next(self) -> None:
        """Do not time the next unit (the caller did something else in between, e.g. an
        evaluation between two epochs)."""
        with self._lock:
            self._skip = True

    def _start_probe(self):
        self._costs = {}
        self._others = []
        self._probe_from = (self._elapsed, self.units, self._samples)
        self._current_side = self._side()
        self.phase, self.left = "current", self.window

    @staticmethod
    def _median(c):
        return sorted(c)[len(c) // 2] if c else None

    def _clearly_worse(self) -> bool:
        other = self._costs.get(self._side(), [])
        ref = self._median(self._costs.get(self._current_side, []))
        if not other or ref is None:
            return False
        # One timed unit is enough when it is far worse (2 x abandon: a loaded machine makes a
        # unit at the full count tens of times slower); two when it is clearly worse.
        if len(other) == 1:
            return other[0] > 2.0 * self.abandon * ref
        return self._median(other) > self.abandon * ref

    def _decide(self):
        cost_full = self._median(self._costs.get("full"))
        cost_one = self._median(self._costs.get("one"))
        full = self.full
        # Ties go to one thread: a wrong "one" costs at most the thread count (1.4-1.8x on two
        # idle cores), a wrong "full" up to tens of times beside a busy process (measured).
        choice = "one"
        if cost_full is None or cost_one is None:
            choice = self._current_side
        elif cost_full < (1.0 - self.margin) * cost_one:
            choice = "full"
        if self.choice is not None:
            self.hold = min(2 * self.hold, self.max_hold) if choice == self.choice \
                else self.base_hold
        self.hold = min(max(self.hold, self._budget_hold(choice, cost_full, cost_one)),
                        self.max_hold)
        self.choice = choice
        self.events.append({"unit": self.units, "full": full, "cost_full": cost_full,
                            "cost_one": cost_one,
                            "threads": 1 if choice == "one" else self.wide,
                            "hold": self.hold, "by": "timing", "others": self.others})
        self.phase, self.left = "hold", self.hold
        self._set(choice == "one")

    def _budget_hold(self, choice, cost_full, cost_one) -> int:
        """The hold that keeps probing within ``probe_budget`` of the time: a probe ran
        ``len + 1`` units (one untimed switch unit) at the losing count, each costing
        ``loser / winner - 1`` winner units more than the winner would have."""
        if cost_full is None or cost_one is None:
            return 0
        win, lose = (cost_full, cost_one) if choice == "full" else (cost_one, cost_full)
        lost_side = "one" if choice == "full" else "full"
        units = len(self._costs.get(lost_side, [])) + 1
        extra = units * (lose / max(win, 1e-30) - 1.0)
        if not extra > 0.0:  # the loser cost no more (NaN: two infinite costs): no lengthening
            return 0
        # A winner of ~0 s against a long loser overflows the ratio to inf, whose int() raised:
        # the hold is capped at max_hold anyway, so cap before converting.
        if extra >= self.max_hold * self.probe_budget:
            return self.max_hold
        return int(-(-extra // self.probe_budget))

    def summary(self) -> Dict:
        """The current choice and the decisions so far (for a log): ``by_signal`` counts the
        decisions the signal made (probes skipped, full count dropped), ``signal`` says
        whether there is one and ``others`` is its last sample; ``wide`` is the wide side's
        count now, ``narrowed`` / ``widened`` how often the room resized it."""
        with self._lock:
            last = self.events[-1] if self.events else None
            by_signal = [e for e in self.events if e.get("by") == "signal"]
            return {"threads": self.threads(), "wide": self.wide, "started": self.started,
                    "narrowed": self.resizes["narrowed"], "widened": self.resizes["widened"],
                    "decisions": len(self.events),
                    "by_signal": len(by_signal),
                    "skipped": sum(e["action"] == "skipped" for e in by_signal),
                    "dropped": sum(e["action"] == "dropped" for e in by_signal),
                    "signal": self.signal is not None, "others": self.others,
                    "last": None if last is None else dict(last)}
