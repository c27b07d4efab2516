"""Errors a user can act on, told apart from bugs.

Every entry point (``pretrain_agent_rl.py`` and the scripts in ``tools/``) runs under
:func:`megatron_psrl.cli.run_cli`, which turns a :class:`PsrlError` or an ``OSError`` into
one line on stderr naming the file (and the sample, field or tensor where there is one) and
exit status 2. Anything else is a bug: its traceback is printed and the status is 1.

The concrete errors keep the builtin base they always had (``ValueError``, ``MemoryError``,
``FileExistsError``), so code that catches those keeps working.
"""

from __future__ import annotations

import os
from typing import Optional


class PsrlError(Exception):
    """Base of every error caused by input, configuration or environment (exit status 2)."""


class ConfigurationError(PsrlError, ValueError):
    """Flags or settings that cannot work together (named in the message)."""


class UnsupportedFeatureError(PsrlError, NotImplementedError):
    """A feature or layout that megatron_psrl does not implement (yet), named in the message."""


class MissingRequirementError(PsrlError, RuntimeError):
    """The machine lacks something the request needs (CUDA, an optional kernel package)."""


class UnsupportedModelError(PsrlError, ValueError):
    """The Hugging Face model uses a feature megatron_psrl does not implement."""


class CheckpointError(PsrlError, ValueError):
    """A checkpoint or model file that is missing, truncated, corrupt or of the wrong shape.

    The message names the file, and the tensor where one is concerned."""

    def __init__(self, path: str, reason: str, tensor: Optional[str] = None):
        self.path = path
        """The file (or folder) concerned."""
        self.reason = reason
        """What is wrong, without the location."""
        self.tensor = tensor
        """The tensor concerned, if any."""
        where = f"{path}: tensor {tensor!r}" if tensor else str(path)
        super().__init__(f"{where}: {reason}")


class CheckpointWriteError(PsrlError, OSError):
    """A checkpoint or output could not be written (disk full, permissions, ...)."""

    def __init__(self, path: str, reason: str):
        self.path = path
        self.reason = reason
        super().__init__(f"cannot write {path}: {reason}")

    def __str__(self) -> str:  # OSError's own __str__ would print the args tuple
        return self.args[0]


class NonFiniteTrainingError(PsrlError, FloatingPointError):
    """Training produced too many consecutive non-finite steps (``--max-skipped-iters``)."""


class CollectiveTimeoutError(PsrlError, RuntimeError):
    """A collective did not complete within ``--distributed-timeout-minutes``."""


def describe_os_error(exc: OSError) -> str:
    """``"<file>: <reason>"`` for an OSError, with the file when the error carries one."""
    reason = exc.strerror or (os.strerror(exc.errno) if exc.errno else None) or str(exc)
    if exc.filename is not None:
        where = str(exc.filename)
        if exc.filename2 is not None:
            where += f" -> {exc.filename2}"
        return f"{where}: {reason}"
    return str(exc) if not exc.strerror else reason


def error_text(exc: BaseException) -> str:
    """What a user-facing error says, on one line (an OSError names its file)."""
    text = describe_os_error(exc) if isinstance(exc, OSError) and not isinstance(exc, PsrlError) else str(exc)
    return " ".join(text.split())


def pid_alive(pid: int) -> bool:
    """A process with this pid exists on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True
