"""Nothing left half done: a file written whole or not at all, a process group stopped whole. The run's
folder, the benchmarks and the developers' tools write and stop through these two; this module imports
nothing heavy, so that a tool that only writes a page loads no torch."""

import os
import signal
import subprocess
from contextlib import suppress
from pathlib import Path


def write_atomically(path: str | Path, data: str | bytes) -> None:
    """`data` to `path` through a temporary file beside it, renamed over it: a reader, or a crash, never sees
    half a file. The temporary file is `path` + ".tmp" (a resumed run removes those a kill left)."""
    temporary = Path(f"{path}.tmp")
    if isinstance(data, bytes):
        temporary.write_bytes(data)
    else:
        temporary.write_text(data)
    os.replace(temporary, path)


def stop_process_group(process: subprocess.Popen, grace: float = 30.0) -> None:
    """SIGTERM to the process group `process` leads (started with start_new_session=True: our scripts then
    stop their engines and write a checkpoint), then SIGKILL to whatever of the group is left after `grace`
    seconds (0: at once), and the leader reaped."""
    for signum, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, None)):
        if signum == signal.SIGTERM and not grace:
            continue
        with suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signum)
        with suppress(subprocess.TimeoutExpired):
            process.wait(timeout=wait)
