"""One writer per checkpoint folder.

A run that saves into ``--save DIR`` holds ``DIR/.psrl-save.lock`` (pid, host, torchrun run id,
start time) from start-up to exit. A second run that tries to save into the same folder is
refused with the holder's pid and host. A lock is taken over when its holder is gone:

- the same host and the pid no longer exists (a crashed or killed run), or
- the same torchrun run id (``TORCHELASTIC_RUN_ID``) and not a live process on this host:
  torchrun restarted the worker group of the same job (``--max-restarts``), possibly with rank
  0 on another node. Run ids must therefore be unique per job (Slurm: the job id).

A lock held from another host by another job cannot be checked from here; the message names
the file to delete once that job is known to be gone.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import time
from typing import Optional

from megatron_psrl.errors import ConfigurationError, pid_alive

LOCK_NAME = ".psrl-save.lock"


def _run_id() -> Optional[str]:
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    return run_id if run_id and run_id != "none" else None


class SaveDirLock:
    """The lock of one checkpoint folder (see the module docstring). Use ``acquire``/``release``."""

    def __init__(self, save_dir: str):
        self.save_dir = os.path.abspath(save_dir)
        self.path = os.path.join(self.save_dir, LOCK_NAME)
        self.held = False
        self.took_over: Optional[dict] = None
        """The stale holder's record when the lock was taken over (for the log)."""

    def _record(self) -> dict:
        return {"pid": os.getpid(), "host": socket.gethostname(), "run_id": _run_id(), "started": time.time()}

    def _read(self) -> Optional[dict]:
        return self._read_file(self.path)

    @staticmethod
    def _read_file(path: str) -> Optional[dict]:
        try:
            with open(path, encoding="utf-8") as f:
                return json.load(f)
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {}  # unreadable: a lock file is complete when it appears (see acquire)

    def _stale(self, holder: dict) -> bool:
        if not holder:
            return True
        same_host = holder.get("host") == socket.gethostname()
        pid = holder.get("pid")
        if same_host and isinstance(pid, int) and pid != os.getpid() and pid_alive(pid):
            return False  # a live process here holds it, whatever its run id
        if _run_id() is not None and holder.get("run_id") == _run_id():
            return True  # an earlier attempt of this torchrun job (maybe on another node)
        return same_host  # here and its process is gone

    def acquire(self) -> "SaveDirLock":
        """Take the lock or raise :class:`ConfigurationError` naming the holder.

        The lock file appears complete or not at all (``link`` of a written temporary, which
        fails if the lock exists), and a stale lock is taken over by renaming it away first,
        so of two processes racing for a stale lock exactly one wins."""
        tmp = f"{self.path}.{os.getpid()}.new"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(self._record(), f)
        try:
            for _ in range(5):
                try:
                    os.link(tmp, self.path)
                    self.held = True
                    return self
                except FileExistsError:
                    pass
                holder = self._read()
                if holder is None:
                    continue  # released meanwhile: try again
                if not self._stale(holder):
                    started = holder.get("started")
                    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)) if started else "unknown"
                    raise ConfigurationError(
                        f"{self.save_dir} is being written by another run (pid {holder.get('pid')} on host "
                        f"{holder.get('host')!r}, started {when}); use another --save folder, or delete "
                        f"{self.path} if that run is gone"
                    )
                stale = f"{self.path}.{os.getpid()}.stale"
                try:
                    os.rename(self.path, stale)  # only one of several contenders gets it
                except FileNotFoundError:
                    continue
                moved = self._read_file(stale)
                if moved and not self._stale(moved):  # a contender's fresh lock: put it back
                    try:
                        os.link(stale, self.path)
                    except FileExistsError:
                        pass
                    os.unlink(stale)
                    continue
                os.unlink(stale)
                self.took_over = holder
            raise ConfigurationError(f"{self.path}: could not take the lock (it keeps changing)")
        finally:
            os.unlink(tmp)

    def release(self) -> None:
        """Remove the lock if this process still holds it."""
        if not self.held:
            return
        self.held = False
        holder = self._read()
        if holder and holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname():
            try:
                os.unlink(self.path)
            except OSError as exc:
                if exc.errno != errno.ENOENT:
                    raise
