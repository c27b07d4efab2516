"""One writer per checkpoint folder.

A run that saves into ``--save DIR`` holds ``DIR/.psrl-save.lock`` (pid, host, torchrun run id,
start time) from start-up to exit. A second run that tries to save into the same folder is
refused with the holder's pid and host. A lock is taken over when its holder is gone:

- the same host and the pid no longer exists (a crashed or killed run), or
- the same torchrun run id (``TORCHELASTIC_RUN_ID``): torchrun restarted the worker group of
  the same job (``--max-restarts``), possibly with rank 0 on another node.

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

from megatron_psrl.errors import ConfigurationError

LOCK_NAME = ".psrl-save.lock"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


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
        try:
            with open(self.path, encoding="utf-8") as f:
                return json.load(f)
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {}  # unreadable or half-written: treat as a stale lock of unknown origin

    def _stale(self, holder: dict) -> bool:
        if not holder:
            return True
        if _run_id() is not None and holder.get("run_id") == _run_id():
            return True
        if holder.get("host") == socket.gethostname():
            pid = holder.get("pid")
            return not isinstance(pid, int) or pid == os.getpid() or not _pid_alive(pid)
        return False

    def acquire(self) -> "SaveDirLock":
        """Take the lock or raise :class:`ConfigurationError` naming the holder."""
        record = json.dumps(self._record())
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
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
                self.took_over = holder
                os.replace(self._write_temp(record), self.path)
                self.held = True
                return self
            else:
                with os.fdopen(fd, "w", encoding="utf-8") as f:
                    f.write(record)
                self.held = True
                return self
        raise ConfigurationError(f"{self.path}: could not take the lock (it keeps changing)")

    def _write_temp(self, text: str) -> str:
        tmp = f"{self.path}.{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
        return tmp

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
