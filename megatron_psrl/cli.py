"""The one top-level error handler of every entry point.

``run_cli(main)`` runs ``main`` and exits the process with the status below; ``call_cli(main)``
returns that status instead (for ``main(argv) -> int`` functions that tests call directly):

- 0 on success (or ``main``'s return value);
- 2 with one line ``error: <file>: <what is wrong>`` for a :class:`~megatron_psrl.errors.PsrlError`
  (bad input, configuration, checkpoint, timeout, non-finite training) or an ``OSError``
  (unwritable folder, full disk, missing file);
- 1 with the traceback for anything else: that is a bug, and the traceback is what fixes it;
- 130 on Ctrl-C, 143 on SIGTERM (both run every ``finally``: the save lock is released).

In a multi-rank job every line is prefixed with the rank that hit it.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import traceback
from typing import Callable, NoReturn, Optional

from megatron_psrl.errors import PsrlError, error_text
from megatron_psrl.options import VERIFY_CHECKSUMS_ENV


def add_checksum_flag(parser) -> None:
    """``--no-verify-checksums``: the same flag on every command line that reads checkpoints."""
    parser.add_argument("--no-verify-checksums", action="store_true",
                        help="do not verify a checkpoint's files against its checksums.sha256 before reading "
                             "them (verification reads every file once more; skip it for huge checkpoints)")


def apply_checksum_flag(args) -> None:
    """Turn verification off for this process (and the processes it starts) when asked."""
    if getattr(args, "no_verify_checksums", False):
        os.environ[VERIFY_CHECKSUMS_ENV] = "0"


EXIT_USER_ERROR = 2
EXIT_BUG = 1
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 143


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """``--help`` as users of Megatron-LM expect: the description as written, and every flag's
    default shown once, where it says something (not for on/off switches, not when unset, not
    when the help text already names it)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        # ``is``, not ``in (None, False)``: 0 and 0.0 equal False, and a zero default (--min-lr,
        # --kl-coef) is worth showing. A flag without a default says in its text what happens
        # without it.
        if ("%(default)" in text or "default" in text.lower()
                or action.default is None or action.default is False or action.default is argparse.SUPPRESS
                or isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction))):
            return text
        return f"{text} (default: %(default)s)" if text else "(default: %(default)s)"


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _prefix() -> str:
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return f"[rank {os.environ.get('RANK', '?')}] "
    return ""


def error_line(exc: BaseException) -> str:
    """The one line printed for a user-facing error."""
    return f"error: {_prefix()}{error_text(exc)}"


def write_error_line(line: str) -> None:
    """Write ``line`` and its newline to stderr in one system call.

    Every rank of a torchrun job shares one stderr; ``print`` writes the text and the newline
    separately, so two ranks failing together could glue their lines into one. A single
    ``write`` of less than PIPE_BUF bytes to a pipe is atomic, and one line per rank is what
    operators (and log scrapers) read."""
    sys.stderr.flush()
    data = (line + "\n").encode("utf-8", "replace")
    try:
        os.write(sys.stderr.fileno(), data)
    except (AttributeError, OSError, ValueError):  # a replaced stderr (pytest capture, a notebook)
        sys.stderr.write(line + "\n")
        sys.stderr.flush()


class Terminated(BaseException):
    """SIGTERM (torchrun stopping its workers, Slurm's scancel, preemption), raised so that every
    ``finally`` runs: locks are released and temporaries removed instead of leaked."""


def _raise_terminated(signum, frame):
    raise Terminated()


def call_cli(main: Callable[[], Optional[int]], cleanup: Optional[Callable[[], None]] = None) -> int:
    """Run ``main`` under the handler described in the module docstring; returns the exit status."""
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        code = main() or 0
    except KeyboardInterrupt:
        write_error_line(f"error: {_prefix()}interrupted")
        code = EXIT_INTERRUPTED
    except Terminated:
        write_error_line(f"error: {_prefix()}terminated (SIGTERM)")
        code = EXIT_TERMINATED
    except (PsrlError, OSError) as exc:
        write_error_line(error_line(exc))
        code = EXIT_USER_ERROR
    except Exception:  # a bug: keep everything needed to fix it
        traceback.print_exc()
        sys.stderr.flush()
        code = EXIT_BUG
    finally:
        if cleanup is not None:
            try:
                cleanup()
            except Exception:  # never mask the real outcome with a shutdown error
                pass
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    return code


def run_cli(main: Callable[[], Optional[int]], cleanup: Optional[Callable[[], None]] = None) -> NoReturn:
    """:func:`call_cli`, then exit the process with its status."""
    sys.exit(call_cli(main, cleanup))
