"""4c. The channel between the generation thread and the trainer (the engines it drives: engine.py).

Cleanba's protocol: rank 0's generation thread (the algorithm file's) and the trainer exchange version-tagged
messages through three queues, which the channel owns: policy versions one way (`weights`), rollouts and
evaluations the other (`rollouts`, `evals`). Every rank receives what the thread generates (next_rollout,
arrived_evaluations). A wait on the other side wakes every half second to see it stop, the engines fail or a
stop signal come; the channel is the training loop's context, which stops the thread and the engines however
the loop ends, with the run's last line."""

import queue
import signal
import sys
import threading

from accelerate.utils import broadcast_object_list

from plumbing.placement import on_cores

_ENGINE_EXIT_SECONDS = 3.0  # how long an engine vLLM's client says is dead may take to be seen dead


class Channel:
    """The queues between the generation thread and the trainer, and the thread itself, over `engine` (an
    Engine: its processes, its stop signals, its failures)."""

    def __init__(self, engine):
        self.engine = engine
        self.weights: queue.Queue = queue.Queue()  # Weights, trainer -> generator (the schedule bounds them)
        self.rollouts: queue.Queue = queue.Queue()  # the algorithm file's Rollout, generator -> trainer
        self.evals: queue.Queue = queue.Queue()  # its EvalRollout, generator -> trainer
        self.thread: threading.Thread | None = None
        self.thread_error: BaseException | None = None  # what ended the generation thread
        self.stopping = threading.Event()  # the generation thread stops at its next get
        self.stop_signal = 0  # the signal that stopped the training loop, on every rank (next_rollout)

    @property
    def is_main(self) -> bool:
        return self.engine.processes is None or self.engine.processes.is_main

    def run_thread(self, target, *args) -> None:
        """Rank 0 runs the generation thread, `target(*args)`, on the engine's cores (it takes turns with
        the engine's processes); an exception in it stops the trainer at its next get, which raises it with
        its traceback. The start is over: from here a signal lets the step finish and writes a checkpoint."""
        if self.is_main:

            def guarded() -> None:
                try:
                    target(*args)
                except SystemExit:  # the trainer stopped it (get)
                    pass
                except BaseException as exc:
                    self.thread_error = exc

            self.thread = threading.Thread(target=guarded, daemon=True)
            with on_cores(self.engine.cores):
                self.thread.start()
        if self.engine.signals is not None:
            self.engine.signals.starting = False

    def get(self, q: queue.Queue, until_signal: bool = False):
        """A blocking get from one of the queues that wakes up every half second to notice the other side
        stopping and, the trainer's, the engine failing (failed): vLLM's client waits forever on an engine
        that froze, and on some that died. `until_signal`: None once a SIGTERM or Ctrl-C came, or the engine
        failed (the trainer writes a checkpoint, then stops); without it, a failed engine ends the run here,
        naming the newest checkpoint."""
        watching = threading.current_thread() is not self.thread
        while not (until_signal and self.engine.signals.received):
            if self.stopping.is_set() and not watching:
                raise SystemExit("stopped")
            if watching and self.failed() is not None:
                if until_signal:
                    return None
                sys.stdout.flush()  # what the run printed comes before its last line
                raise SystemExit(self.engine.failure_line())
            try:
                return q.get(timeout=0.5)
            except queue.Empty:
                continue
        return None

    def failed(self) -> str | None:
        """Why the engine failed, as the trainer sees it while it waits (Engine.failed: a process of it died,
        or a call to it is past its deadline); the generation thread then stops at its next get, or is left to
        the interpreter's exit (a daemon, maybe stuck in vLLM). A failure of the generation thread itself is
        raised, with its traceback (once: the thread prints none)."""
        engine, error = self.engine, self.thread_error
        if engine.failure is None and error is not None and not engine.died():
            # vLLM's client raises its EngineDeadError as the engine dies: see which of its processes did
            engine_dead = "EngineDeadError" in (kind.__name__ for kind in type(error).__mro__)
            if not (engine_dead and engine.died(wait=_ENGINE_EXIT_SECONDS)):
                failure = f"the generation thread failed: {type(error).__name__}: {error}"
                raise RuntimeError(failure) from error
        if engine.failed() is not None:
            self.stopping.set()
        return engine.failure

    def next_rollout(self):
        """The step's rollout, which rank 0 takes from the generation thread, on every rank; None once a stop
        signal came first (its number: stop_signal) or the engine failed (why: the engine's failure)."""
        engine = self.engine
        rollout = received = failure = None
        if self.is_main:
            rollout = self.get(self.rollouts, until_signal=True)
            failure = engine.failure
            received = engine.signals.received[0] if rollout is None and failure is None else 0
        rollout, self.stop_signal, engine.failure = broadcast_object_list([rollout, received, failure])
        return rollout

    @property
    def stopped(self) -> bool:
        """Whether the training loop stopped early: a signal, or the engine failed."""
        return bool(self.stop_signal or self.engine.failure)

    def arrived_evaluations(self, wait: bool = False) -> list:
        """The evaluations the generation thread has finished (`wait`: at least one, waited for), on the
        processes that evaluate (Processes.evaluates)."""
        arrived = []
        if self.is_main:
            if wait:
                arrived.append(self.get(self.evals, until_signal=True))
                if arrived[-1] is None:
                    self.stop_owing_evaluations()
            while not self.evals.empty():
                arrived.append(self.evals.get())
        processes = self.engine.processes
        return processes.broadcast(arrived) if processes.zero_stage == 3 else arrived

    def stop_owing_evaluations(self) -> None:
        """Rank 0's wait for the final evaluations, ended by the engine failing or a stop signal: after the
        last step no checkpoint can be written (the final evaluations' versions are owed), so the run stops
        now, naming the newest checkpoint, from which --resume trains the steps after it again."""
        engine = self.engine
        sys.stdout.flush()  # what the run printed comes before its last line
        if engine.failure is not None:
            raise SystemExit(engine.failure_line())
        received = engine.signals.received[0]
        owed = "no checkpoint can be written while the final evaluations are owed, after the last step"
        sys.stderr.write(f"{signal.Signals(received).name}: {owed}: stopping now; {engine.resume()}\n")
        raise SystemExit(128 + received)

    def __enter__(self) -> "Channel":
        return self

    def __exit__(self, kind, error, trace) -> None:
        """The thread and the engine stop however the training loop ended: a second Ctrl-C
        (KeyboardInterrupt) ends the run with status 130, a stop signal that ended the loop with 128 + its
        number, the engine failing with 1 and one last line (Engine.failure_line), after the loop's
        checkpoint; a training process that died (one process of the others' collective gone:
        Processes.lost) with 1 and one line, without the traceback of the collective that found it, naming it
        and the checkpoint to resume from."""
        engine = self.engine
        self.stop()
        if kind is KeyboardInterrupt:
            print("interrupted: stopped the generation thread and the engine")
            raise SystemExit(130)
        if error is not None and engine.processes is not None and (lost := engine.processes.lost(error)):
            line, speaks = lost
            # the launcher's signal, sent as it saw it die
            if engine.signals is not None and engine.signals.received:
                line += ": the checkpoint the stop signal asked for cannot be written without it"
            sys.stdout.flush()  # what the run printed comes before its last line
            raise SystemExit(f"error: {line}; {engine.resume()}" if speaks else 1) from None
        if kind is None and engine.failure:
            sys.stdout.flush()  # what the run printed comes before its last line
            raise SystemExit(engine.failure_line() if self.is_main else 1)
        if kind is None and self.stop_signal:
            raise SystemExit(128 + self.stop_signal)

    def stop(self) -> None:
        """Stops the generation thread and the engine, each wait with a deadline; the engine holds nothing to
        save, so nothing waits on its exit."""
        self.stopping.set()
        if not self.engine.llms:
            return
        # the thread finishes the batch it is generating, or the engines' shutdown ends it; a daemon, one
        # stuck in vLLM (a failed engine's) does not keep the process alive
        waits = (0, 0) if self.engine.failure else (1, 5)
        if self.thread is not None:
            self.thread.join(timeout=waits[0])
        self.engine.shut_down()
        if self.thread is not None:
            self.thread.join(timeout=waits[1])
        self.engine.release()
