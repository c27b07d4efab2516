"""Send this process's output (Python's streams and file descriptors 1 and 2) to given files
for a while, then restore it: for running a script as ``__main__`` inside a process that is
not its own (``faults.run_here`` in the pytest process, ``torchrun_cases.py`` on every rank of
a shared launch)."""

import contextlib
import io
import os
import sys
from typing import Iterator


@contextlib.contextmanager
def output_to(stdout_fd: int, stderr_fd: int) -> Iterator[None]:
    """Inside: file descriptors 1 and 2 are copies of ``stdout_fd`` and ``stderr_fd`` (what
    libraries write there, and ``os.write`` to ``sys.stderr.fileno()``), and ``sys.stdout`` /
    ``sys.stderr`` write to them too (a test runner may have replaced Python's streams by
    objects that are not on descriptors 1 and 2)."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved_fds = os.dup(1), os.dup(2)
    saved_streams = sys.stdout, sys.stderr
    streams = tuple(io.TextIOWrapper(os.fdopen(os.dup(fd), "wb"), write_through=True) for fd in (stdout_fd, stderr_fd))
    os.dup2(stdout_fd, 1)
    os.dup2(stderr_fd, 2)
    sys.stdout, sys.stderr = streams
    try:
        yield
    finally:
        sys.stdout, sys.stderr = saved_streams
        for stream in streams:
            stream.close()
        os.dup2(saved_fds[0], 1)
        os.dup2(saved_fds[1], 2)
        for fd in saved_fds:
            os.close(fd)
