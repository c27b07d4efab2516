"""A hung rank does not hang the job: with --distributed-timeout-minutes 0.1 a rank stopped
with SIGSTOP makes its peer fail within the timeout, with one line naming the collective it was
in and the rank it waited on, and torchrun ends the job."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from helpers.torchrun import REPO_ROOT, free_port, script_env, worker_pids

pytestmark = pytest.mark.slow  # a torchrun job

TIMEOUT_MINUTES = 0.1  # 6 s


def _wait_for(predicate, seconds, what):
    deadline = time.time() + seconds
    while time.time() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def test_sigstopped_rank_ends_the_job_with_a_named_timeout(tmp_path):
    log = tmp_path / "log.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", os.path.join(REPO_ROOT, "pretrain_agent_rl.py"),
           "--model", "debug-llama", "--data", "grpo", "--micro-batch-tokens", "512", "--train-iters", "100000",
           "--distributed-timeout-minutes", str(TIMEOUT_MINUTES), "--log-json", str(log)]
    agent = subprocess.Popen(cmd, cwd=REPO_ROOT, env=script_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             text=True)
    err_lines: list = []

    def read_stderr():
        for line in agent.stderr:
            err_lines.append(line)

    reader = threading.Thread(target=read_stderr, daemon=True)
    reader.start()
    stopped = None
    try:
        _wait_for(lambda: log.exists() and len(log.read_text().splitlines()) >= 2, 180, "two iterations")
        workers = worker_pids(agent.pid)
        assert sorted(workers) == [0, 1], workers
        stopped = workers[1]
        os.kill(stopped, signal.SIGSTOP)
        t0 = time.time()
        _wait_for(lambda: any(line.startswith("error: [rank 0]") for line in err_lines), 120, "rank 0's error")
        elapsed = time.time() - t0
        # What is tested ends here. torchrun would now SIGTERM the stopped rank and wait its 30 s
        # grace period before SIGKILL (a stopped process handles no signal but SIGKILL): do it now.
        os.kill(stopped, signal.SIGKILL)
        agent.wait(timeout=120)
        reader.join(timeout=30)
    finally:
        if stopped is not None:
            try:
                os.kill(stopped, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if agent.poll() is None:
            agent.kill()
            agent.wait()
    err = "".join(err_lines)
    assert agent.returncode != 0
    # rank 0 noticed within the timeout (6 s, plus the time its current collective had run)
    assert elapsed < 60, elapsed
    lines = [line for line in err.splitlines() if line.startswith("error: [rank 0]")]
    assert len(lines) == 1, err[-4000:]
    line = lines[0]
    assert "timed out on rank 0 (--distributed-timeout-minutes 0.1)" in line, line
    assert "waiting on rank 1 (not responding" in line, line
    assert "iteration" in line  # the phase names the iteration it was in
    assert all(json.loads(x)["iter"] >= 1 for x in log.read_text().splitlines())
