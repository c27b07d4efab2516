"""A rank that dies in the middle of a cross-rank step (its peers wait on its prefix K/V) does
not hang the job: the peers fail at once on the closed connection, torchrun ends the job and
names the dead rank, well within --distributed-timeout-minutes."""

import os
import signal
import subprocess
import sys
import time

import pytest
from helpers.torchrun import REPO_ROOT, free_port, script_env, worker_pids

pytestmark = pytest.mark.slow  # a torchrun job


def test_killed_rank_ends_the_job_naming_it(tmp_path):
    log = tmp_path / "log.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", os.path.join(REPO_ROOT, "pretrain_agent_rl.py"),
           "--model", "debug-llama", "--data", "tree", "--micro-batch-tokens", "128", "--placement", "cross-rank",
           "--train-iters", "100000", "--distributed-timeout-minutes", "2", "--log-json", str(log)]
    agent = subprocess.Popen(cmd, cwd=REPO_ROOT, env=script_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
    try:
        deadline = time.time() + 300
        while not (log.exists() and len(log.read_text().splitlines()) >= 2):
            assert time.time() < deadline and agent.poll() is None, "training did not start"
            time.sleep(0.2)
        assert '"cross-rank"' in log.read_text()
        victim = worker_pids(agent.pid)[1]
        t0 = time.time()
        os.kill(victim, signal.SIGKILL)
        _, err = agent.communicate(timeout=110)  # under the 2-minute collective timeout
        elapsed = time.time() - t0
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
    assert agent.returncode != 0
    assert elapsed < 120, elapsed  # --distributed-timeout-minutes 2: the peers did not wait it out
    # torchrun's report names the rank that died first, and how
    assert "rank      : 1" in err and "SIGKILL" in err, err[-3000:]
    assert not [pid for pid in worker_pids(agent.pid).values()]  # no rank left behind
