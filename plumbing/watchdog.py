"""5. The watchdog: a program of its own that cleans up after a trainer that died without doing so, and the
functions that end the engine's processes and release what they held, which the trainer calls too.

The trainer starts it (start_watchdog) before the engine, in a session of its own (a Ctrl-C to the terminal
does not reach it), as `python -P plumbing/watchdog.py`: it imports the standard library and psutil only, so
it is up at once. It watches the trainer's children (a second apart) and the shared memory files they and the
trainer map, and blocks reading a pipe whose only write end the trainer holds. If the trainer dies, however it
dies (kill -9 of it or of its process group included, during the engine's start too), the pipe closes: it then
kills those children, which would live on re-parented to init (an engine holding its GPU), removes the weights
folder, lets the trainer's resource tracker (if alive) unlink what it knows of and unlinks the rest of those
files, unmapped now. Its input, a line each: the weights folder as JSON, then "done" when the trainer stopped
its engine itself (it exits)."""

import json
import os
import re
import select
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil


def start_watchdog() -> subprocess.Popen:
    """The watchdog's process; its stdin takes the weights folder (as the engine starts), then "done"."""
    command = [sys.executable, "-P", os.path.abspath(__file__)]  # -P: our folder is not put first on its path
    return subprocess.Popen(command, stdin=subprocess.PIPE, start_new_session=True, text=True)


def _watch() -> None:
    """The watchdog's loop (module docstring), reading its stdin."""
    trainer, folder, received = psutil.Process(os.getppid()), None, b""
    watched, trackers, files = {}, {}, set()  # the trainer's children, its resource trackers, their files
    while True:
        if select.select([0], [], [], 1.0)[0]:
            if not (data := os.read(0, 65536)):
                break  # the trainer is dead: its end of the pipe closed
            *lines, received = (received + data).split(b"\n")
            if b"done" in lines:
                return
            folder = json.loads(lines[-1])["folder"] if lines else folder
        try:
            for process in trainer.children(recursive=True):
                if process.pid != os.getpid() and process.pid not in watched and process.pid not in trackers:
                    (trackers if _is_resource_tracker(process) else watched)[process.pid] = process
            watched = {pid: process for pid, process in watched.items() if process.is_running()}
            files.update(shared_memory_files([trainer, *watched.values()]))
        except psutil.Error:
            pass  # the trainer is gone, or a child: the pipe says so next
    kill_process_trees(list(watched.values()))
    if folder:
        shutil.rmtree(folder, ignore_errors=True)
    psutil.wait_procs(list(trackers.values()), timeout=5)
    release_orphaned_shared_memory(sorted(files))


def dead_processes(processes: list[psutil.Process], wait: float = 0) -> list[int]:
    """The pids of these processes that are dead (a zombie is), looking again for up to `wait` seconds until
    one is."""
    deadline = time.monotonic() + wait
    while True:
        dead = []
        for process in processes:
            try:
                if process.status() == psutil.STATUS_ZOMBIE:
                    dead.append(process.pid)
            except psutil.NoSuchProcess:
                dead.append(process.pid)
        if dead or time.monotonic() >= deadline:
            return dead
        time.sleep(0.1)


def kill_process_trees(processes: list[psutil.Process], timeout: float = 5) -> None:
    """SIGKILL these processes and all they started, each stopped first so none can start another between our
    listing its children and killing it. Waits (up to `timeout`) for them to die without reaping them (vLLM
    reaps its own)."""
    stopped, todo = {}, list(processes)
    while todo:
        process = todo.pop()
        try:
            if process.pid not in stopped:
                process.suspend()
                stopped[process.pid] = process
                todo.extend(process.children())
        except psutil.Error:
            pass
    for process in stopped.values():
        try:
            process.kill()
        except psutil.Error:
            pass
    deadline = time.time() + timeout
    while len(dead_processes(list(stopped.values()))) < len(stopped) and time.time() < deadline:
        time.sleep(0.02)


def _is_resource_tracker(process: psutil.Process) -> bool:
    return "multiprocessing.resource_tracker" in " ".join(process.cmdline())


def started_processes(before: set[int]) -> list[psutil.Process]:
    """Children of this process not in `before`, but for Python's resource tracker (multiprocessing starts it
    here for the engine: it must outlive the engine to clean up after it)."""
    started = []
    for process in psutil.Process().children(recursive=True):
        try:
            if process.pid not in before and not _is_resource_tracker(process):
                started.append(process)
        except psutil.Error:
            pass
    return started


def release_shared_memory(paths: list[str]) -> None:
    """Unlink the message queues (psm_*) and the semaphores (sem.mp-*) of the engine's processes, dead now:
    killed by their shutdown's timeout or by a fault, they could not (vLLM's scheduler unlinks its queue only
    after its worker exits, seconds later). Python's resource tracker is told, or it would unlink them again
    at exit with a "leaked shared_memory (semaphore) objects" warning, after the run's last line. A file still
    mapped is left."""
    from multiprocessing import resource_tracker

    for path in release_orphaned_shared_memory(paths):
        name = os.path.basename(path)
        kind = "shared_memory" if name.startswith("psm_") else "semaphore"
        resource_tracker.unregister("/" + name.removeprefix("sem."), kind)  # the names Python registered


def _mapped_inodes(folder: str = "/dev/shm", pids: list[int] | None = None) -> set[int]:
    """The inodes of the files in `folder` that these processes (None: any process) map. By inode, not name:
    glibc creates a named semaphore under a temporary name and then links it to its own, so the maps show the
    temporary name, deleted."""
    maps_files = (
        Path("/proc").glob("[0-9]*/maps") if pids is None else [Path(f"/proc/{pid}/maps") for pid in pids]
    )
    inodes = set()
    for maps in maps_files:
        try:
            inodes.update(
                int(line.split()[4]) for line in maps.read_text().splitlines() if f" {folder}/" in line
            )
        except OSError:
            pass  # a process gone, or not ours
    return inodes


def shared_memory_files(processes: list[psutil.Process], folder: str = "/dev/shm") -> list[str]:
    """The message queues (psm_*) and multiprocessing's named semaphores (sem.mp-*) in `folder` that these
    processes map: what their resource trackers would unlink at exit."""
    inodes = _mapped_inodes(folder, [process.pid for process in processes])
    paths = [p for pattern in ("psm_*", "sem.mp-*") for p in Path(folder).glob(pattern)]
    return sorted(str(p) for p in paths if p.exists() and p.stat().st_ino in inodes)


def release_orphaned_shared_memory(
    paths: list[str] | None = None, folder: str = "/dev/shm", min_age: float = 60
) -> list[str]:
    """Unlink the message queues (psm_*) and multiprocessing's named semaphores (sem.mp-*) that no process
    maps any more: what a run killed together with its resource trackers (SIGKILL to its process group, the
    out-of-memory killer) leaves in RAM until the machine reboots (400 MiB an engine). `paths`: these (an
    engine's own), of any age; None: every such file of ours in `folder` unchanged for `min_age` seconds (a
    queue in use is written to, a newer one may belong to a run still starting). Returns what was unlinked."""
    mapped = _mapped_inodes(folder)
    if paths is None:
        paths = [str(p) for pattern in ("psm_*", "sem.mp-*") for p in Path(folder).glob(pattern)]
        paths = [
            p
            for p in paths
            if os.stat(p).st_uid == os.getuid() and time.time() - os.stat(p).st_mtime > min_age
        ]
    released = []
    for path in paths:
        try:
            if os.stat(path).st_ino not in mapped:
                os.unlink(path)
                released.append(path)
        except OSError:
            pass  # gone, or not ours
    return released


def remove_stale_weights_folders(parent: str) -> list[str]:
    """Remove the weights folders (policy-weights-<pid>-*) of trainers no longer alive: what a trainer killed
    together with its watchdog leaves in RAM. Returns the folders removed."""
    removed = []
    for path in Path(parent).glob("policy-weights-*"):
        match = re.fullmatch(r"policy-weights-(\d+)-\w+", path.name)
        if match and not psutil.pid_exists(int(match.group(1))):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(str(path))
    return removed


if __name__ == "__main__":
    _watch()
