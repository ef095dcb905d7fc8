"""4c. What stops a run while its engine works: the deadline of each call to the engine (Deadlines) and the
stop signals, SIGTERM and Ctrl-C (StopSignals). The engine (plumbing/engine.py) holds one of each: it makes
every call under its deadline, which the trainer watches while it waits, and starts under the signals'
own start deadline."""

import gc
import os
import shutil
import signal
import time
from contextlib import contextmanager
from typing import NamedTuple

from plumbing.watchdog import (
    kill_process_trees,
    release_shared_memory,
    shared_memory_files,
    started_processes,
)

# == The deadlines of the calls to the engine ================================================================
# The engine's start and the first call of each kind may compile (on a GPU: the model with torch.compile, CUDA
# graphs, vLLM's sampler kernels and FlashInfer's JIT, minutes for a large model; on a CPU: the sampler's
# kernels, about 20 s on a fresh machine here, minutes on a busy one): they get this much more than
# --engine_timeout_minutes, which a start that freezes meets from its first second, stated at start.
_COMPILE_MINUTES = {"CPU": 5.0, "GPU": 30.0}
_SLOWEST_MULTIPLE = 10  # a later call may take this many times the slowest of its kind so far
# What each kind of call is, by its index
_KINDS = {
    "weight push": "the weight push of policy version {}",
    "rollout": "the rollout of step {}",
    "segment": "a segment of the rollouts in flight from step {}",
    "evaluation": "the evaluation of policy version {}",
}


class Call(NamedTuple):
    """A call to the engine in flight, with its deadline (seconds after its start) and why it is that."""

    kind: str
    index: int
    start: float  # time.monotonic()
    deadline: float
    why: str

    def describe(self, now: float) -> str:
        what, elapsed = _KINDS[self.kind].format(self.index), now - self.start
        return f"{what} had no answer in {elapsed:.1f} s, its deadline {self.deadline:.1f} s ({self.why})"


class Deadlines:
    """How long each call to the engine (a weight push, a rollout, an evaluation) may take before the engine
    counts as frozen (a stuck kernel, a deadlocked collective, a stopped process, which vLLM's client waits on
    forever): a run measures its own pace. The first call of each kind, and the engine's start, may compile:
    --engine_timeout_minutes and _COMPILE_MINUTES on the run's device; it is not counted as the kind's pace. A
    later call gets _SLOWEST_MULTIPLE times the slowest later one of its kind so far, at least
    --engine_timeout_minutes. Generous, so that a slow call is not taken for a frozen one, but bounded:
    peers' runs wait 30 minutes on a stuck weight sync, or forever (AReaL #1439, TRL #6796)."""

    def __init__(self, timeout_minutes: float, on_gpu: bool):
        self.least, self.device = 60 * timeout_minutes, "GPU" if on_gpu else "CPU"
        self.compile = 60 * _COMPILE_MINUTES[self.device]
        self.first = self.least + self.compile
        self.done: dict[str, int] = {}  # kind -> calls that answered
        self.slowest: dict[str, float] = {}  # kind -> seconds, the slowest call after the first
        self.open: Call | None = None  # the call in flight (the generation thread makes one at a time)

    def first_why(self, what: str) -> str:
        least, more = f"--engine_timeout_minutes {self.least / 60:g}", f"{self.compile / 60:g}"
        return f"{what} may compile: {least} + {more} minutes on a {self.device}"

    def start_failed(self, which: str) -> str:
        """What a start past its deadline says (`which`: the engine that did not start)."""
        why = self.first_why("its start")
        return f"{which} did not start in {self.first / 60:g} minutes ({why}): stopped it"

    def stated(self) -> str:
        """The deadlines, as the run states them as the engine starts."""
        return (
            f"engine deadlines: its start and the first weight push, rollout and evaluation "
            f"{self.first / 60:g} minutes each (--engine_timeout_minutes {self.least / 60:g} + "
            f"{self.compile / 60:g} for vLLM's first compile on a {self.device}); a later call "
            f"{self.least / 60:g}, or {_SLOWEST_MULTIPLE} times the slowest of its kind so far if longer"
        )

    def deadline(self, kind: str) -> tuple[float, str]:
        """A new call's deadline, in seconds, and why it is that."""
        if not self.done.get(kind):
            return self.first, self.first_why(f"the first {kind}")
        least = f"--engine_timeout_minutes {self.least / 60:g}"
        paced = _SLOWEST_MULTIPLE * self.slowest.get(kind, 0.0)
        if paced <= self.least:
            return self.least, least
        slowest = f"{_SLOWEST_MULTIPLE} x the slowest {kind} so far, {self.slowest[kind]:.2f} s"
        return paced, f"{slowest}, more than {least}"

    def answered(self, kind: str, seconds: float) -> None:
        """A call of `kind` answered after `seconds`."""
        if self.done.get(kind):
            self.slowest[kind] = max(self.slowest.get(kind, 0.0), seconds)
        self.done[kind] = self.done.get(kind, 0) + 1

    @contextmanager
    def call(self, kind: str, index: int):
        self.open = Call(kind, index, time.monotonic(), *self.deadline(kind))
        try:
            yield
        finally:
            call, self.open = self.open, None
        self.answered(kind, time.monotonic() - call.start)

    def overdue(self, now: float) -> Call | None:
        """The call in flight if it is past its deadline."""
        call = self.open
        return call if call is not None and now - call.start > call.deadline else None


# == The signals that stop the run ==========================================================================
# A launcher (accelerate's, torchrun's) forwards the signal it gets to each training process, which a Ctrl-C
# at the terminal or a scheduler's SIGTERM to the job has reached already: the same signal again within this
# many seconds is that copy, not a second signal (torch/distributed/elastic/agent/server/api.py, _shutdown).
_FORWARDED_SECONDS = 2.0


class StopSignals:
    """SIGTERM (pre-emption) or Ctrl-C. Once the engine runs: finish the step, write a checkpoint, exit; a
    second signal exits at once. While starting: kill the processes started so far and exit at once, as vLLM
    cannot be left to stop: its start-up handshake swallows KeyboardInterrupt, and its wait for the engine's
    ready message does not notice the engine dying (as a Ctrl-C to the process group makes it), so it waits
    out a 10-minute timeout. The start has a deadline too (start_deadline), kept the same way. Only the
    process that `speaks` (rank 0) says so."""

    def __init__(self, speaks: bool = True):
        self.received, self.starting, self.weights_dir, self.watchdog = [], True, None, None
        self.speaks, self.first_at = speaks, 0.0
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, self.handle)

    def handle(self, signum, frame):
        name = signal.Signals(signum).name
        if self.starting:
            message = f"\n{name} while starting: stopping the engine and exiting\n" if self.speaks else ""
            self.exit_at_once(message, 128 + signum)
        if self.received:  # under a launcher, which forwards the signal: a second one, or its copy
            if signum in self.received and time.monotonic() - self.first_at < _FORWARDED_SECONDS:
                return
            signal.signal(signum, signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL)
            signal.raise_signal(signum)
            return
        if self.speaks:
            os.write(2, f"\n{name}: writing a checkpoint at the end of this step, then exiting\n".encode())
        self.received.append(signum)
        self.first_at = time.monotonic()
        # without a launcher a second signal exits at once, even while this process runs C code
        if "TORCHELASTIC_RUN_ID" not in os.environ:
            signal.signal(signum, signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL)

    def exit_at_once(self, message: str, status: int):
        """Says `message`, kills the processes started so far (the watchdog aside: it goes on to clean up
        after the exit) and exits with `status`."""
        os.write(2, message.encode())
        watchdog = self.watchdog.pid if self.watchdog else None
        started = [process for process in started_processes(set()) if process.pid != watchdog]
        shared_memory = shared_memory_files(started)
        kill_process_trees(started)
        # what they mapped, released and told to the resource tracker, which would say "leaked ... objects"
        # after the run's last line
        release_shared_memory(shared_memory)
        if self.weights_dir is not None:
            shutil.rmtree(self.weights_dir, ignore_errors=True)
        gc.freeze()  # the interpreter's exit would garbage-collect the whole heap (seconds)
        raise SystemExit(status)

    @contextmanager
    def start_deadline(self, seconds: float, line: str):
        """The engine's start, in the main thread, ends the run at once (exit status 1) with `line` if it
        takes over `seconds`: a timer signal (SIGALRM) interrupts whatever it waits on, as SIGTERM does."""

        def overdue(signum, frame):
            self.exit_at_once(f"{line}\n", 1)

        previous = signal.signal(signal.SIGALRM, overdue)
        signal.setitimer(signal.ITIMER_REAL, seconds)
        try:
            yield
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
