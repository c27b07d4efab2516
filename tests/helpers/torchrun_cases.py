"""Run several cases of torchrun test scripts in ONE launch (started by
``helpers.torchrun.run_torchrun_cases``): every rank runs each case's script as ``__main__`` in
turn, with that case's arguments, so the Python, torch and megatron-core imports are paid once
for all of them. A script that ends its process groups (``actor.close()``,
``shutdown_parallel()``) is fine: the next case starts them again.

    torchrun --nproc_per_node N torchrun_cases.py CASES.json

``CASES.json``: ``[{"id": ..., "script": ..., "args": [...], "log": PATH}, ...]``. While a case
runs, everything a rank writes to its stdout and stderr (file descriptors 1 and 2: Python's
and the libraries' own output) goes to ``PATH.rank<RANK>``, and is copied to the launch's
output after the case. Every rank creates ``PATH.done.rank<RANK>`` after each case that ran to
its end on it (and rank 0 prints ``CASE_DONE <id>``);
the first case that raises prints its traceback and ends the launch (the later cases do not
run).
"""

import json
import os
import runpy
import sys
import traceback

from helpers.output_capture import output_to

DONE = "CASE_DONE "


def _run(case) -> None:
    sys.argv = [case["script"], *case["args"]]
    sys.path[0] = os.path.dirname(os.path.abspath(case["script"]))  # as when the script is run itself
    try:
        runpy.run_path(case["script"], run_name="__main__")
    except SystemExit as e:
        if e.code not in (None, 0):
            print(f"case {case['id']} exited with {e.code!r} on rank {rank}", file=sys.stderr, flush=True)
            raise
    except BaseException:
        print(f"case {case['id']} failed on rank {rank}:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        raise


def _captured(case) -> None:
    """:func:`_run` with its output sent to the case's log (then copied out)."""
    log = f"{case['log']}.rank{rank}"
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        with output_to(fd, fd):
            _run(case)
    finally:
        os.close(fd)
        with open(log, errors="replace") as f:
            sys.stdout.write(f.read())
        sys.stdout.flush()


with open(sys.argv[1]) as f:
    cases = json.load(f)
rank = os.environ.get("RANK", "0")
for case in cases:
    _captured(case)
    open(f"{case['log']}.done.rank{rank}", "w").close()
    if rank == "0":
        print(DONE + case["id"], flush=True)
