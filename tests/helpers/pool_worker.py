"""One rank of a launch pool (started by ``helpers.launch_pool``): it imports torch, megatron-core,
the package and the Hugging Face model code ONCE, then, for each request the test process
writes into the pool's folder, forks a child that runs the requested script as ``__main__``
with the request's arguments and environment, and records the child's exit code.

    torchrun --nproc_per_node N pool_worker.py POOL_DIR OWNER_PID    (a multi-rank pool)
    python pool_worker.py POOL_DIR OWNER_PID                         (a one-process pool)

``OWNER_PID``: the test session's process; the worker ends when it is gone.

Why fork: a forked child starts from the state right after the imports (no state left by an
earlier case: no process group, no patched class, no heap grown by a previous step), at the
cost of a fork instead of 10-25 s of imports per launch on a 2-core machine. The parent runs
no tensor operation before forking (so no OpenMP pool exists to break in the child).

Each case's child makes its own process group on the request's ``MASTER_PORT`` (rank 0 serving
the store), so nothing of an earlier case's rendezvous is read by a later one.

Request ``POOL_DIR/req<K>.json``: ``{"script" (or "code", as ``python -c``), "args", "env", "cwd",
"log", "port", "split"}``. The child's stdout and stderr (file descriptors 1 and 2) go to
``log.rank<RANK>`` (stderr to ``log.err.rank<RANK>`` when ``split``); its exit status is
written to ``POOL_DIR/req<K>.exit.rank<RANK>``. ``POOL_DIR/stop`` ends the worker.
"""

import json
import os
import runpy
import sys
import time
import traceback
import warnings

POLL_S = 0.05  # how often an idle rank looks for a request (every 10 ms, an idle rank took ~2.5% of a core)
LAUNCH_ENV = dict(os.environ)
# what torchrun sets for its workers: kept in every case's environment
LAUNCH_KEYS = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
               "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}


def _preimport() -> None:
    """What nearly every case imports; anything missing is simply left to the case."""
    warnings.filterwarnings("ignore")
    for name in ("torch", "torch.distributed", "megatron.core", "megatron.core.parallel_state",
                 "megatron_psrl.engine.engine", "megatron_psrl.rl.actor", "megatron_psrl.checkpoint.loading",
                 "transformers", "transformers.models.llama.modeling_llama",
                 "transformers.models.qwen2.modeling_qwen2", "transformers.models.qwen3.modeling_qwen3",
                 "helpers.hf_reference"):
        try:
            __import__(name)
        except Exception:  # noqa: BLE001 -- a case that needs it reports its own import error
            pass
    warnings.resetwarnings()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _child(request: dict, rank: str) -> int:
    """Runs in the forked child: the case's script as ``__main__``; returns its exit code."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    out = os.open(f"{request['log']}.rank{rank}", flags, 0o644)
    err = os.open(f"{request['log']}.err.rank{rank}", flags, 0o644) if request.get("split") else out
    os.dup2(out, 1)
    os.dup2(err, 2)
    env = dict(request["env"])
    env.update({key: value for key, value in LAUNCH_ENV.items() if key in LAUNCH_KEYS or key.startswith("TORCHELASTIC_")})
    if "port" in request:  # a fresh store for this case (rank 0 serves it), not the agent's
        env.update(MASTER_PORT=str(request["port"]), TORCHELASTIC_USE_AGENT_STORE="False")
    os.environ.clear()
    os.environ.update(env)
    os.chdir(request["cwd"])
    script = request.get("script")
    sys.argv = [script or "-c", *request["args"]]
    # as when the script is run itself (python -c: the working folder)
    sys.path[0] = os.path.dirname(os.path.abspath(script)) if script else ""
    try:
        if script:
            runpy.run_path(script, run_name="__main__")
        else:
            exec(compile(request["code"], "<string>", "exec"), {"__name__": "__main__"})
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if e.code is not None and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 -- the case's failure, reported as its output
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    return code


def main() -> None:
    pool_dir, owner = sys.argv[1], int(sys.argv[2])
    rank = os.environ.get("RANK", "0")
    _preimport()
    k = 0
    while True:
        request_path = os.path.join(pool_dir, f"req{k}.json")
        while not os.path.exists(request_path):
            if os.path.exists(os.path.join(pool_dir, "stop")) or not _alive(owner):
                return  # the test session ended (or was killed)
            time.sleep(POLL_S)
        with open(request_path) as f:
            request = json.load(f)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = _child(request, rank)
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        exit_path = os.path.join(pool_dir, f"req{k}.exit.rank{rank}")
        with open(exit_path + ".tmp", "w") as f:
            f.write(str(os.waitstatus_to_exitcode(status)))
        os.replace(exit_path + ".tmp", exit_path)
        k += 1


if __name__ == "__main__":
    main()
