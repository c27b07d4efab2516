"""The test session's launch pools (tests/helpers/launch_pool.py): a case runs on every rank of a
pool as its own forked process, starts from the pool's post-import state (nothing an earlier
case changed carries over), makes its own process group, reports each rank's output and exit
code, and a failed case does not hang or poison the next one."""

import os
import subprocess
import sys

import pytest
from helpers.launch_pool import pool_for, run_python
from helpers.torchrun import run_torchrun, script_env

pytestmark = pytest.mark.slow  # starts pools of processes (once per session)

# a two-rank case: a collective over its own process group, and what it finds of the process
CASE = """
import os, sys, torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
print(f"rank {dist.get_rank()} sum {t.item():g} dtype {torch.get_default_dtype()} argv {sys.argv[1:]}")
if len(sys.argv) > 1 and sys.argv[1] == "leave-state":
    torch.set_default_dtype(torch.float64)  # would leak into the next case in a shared process
if len(sys.argv) > 1 and sys.argv[1] == "fail-rank-1" and dist.get_rank() == 1:
    raise SystemExit(3)
if len(sys.argv) > 1 and sys.argv[1] == "fail-rank-1":
    dist.barrier()  # rank 0 waits for the failed rank: the pool must end it, not hang
dist.destroy_process_group()
"""


@pytest.fixture(scope="module")
def case_script(tmp_path_factory):
    path = tmp_path_factory.mktemp("pool") / "case.py"
    path.write_text(CASE)
    return str(path)


def test_cases_run_on_every_rank_with_their_own_group_and_fresh_state(case_script):
    first = run_torchrun(case_script, ["leave-state"], nproc=2, timeout=120)
    second = run_torchrun(case_script, ["again"], nproc=2, timeout=120)
    for rank in (0, 1):
        assert f"rank {rank} sum 3 dtype torch.float32 argv ['leave-state']" in first, first
        # the first case's default dtype did not carry over: each case is a fork of the pool
        assert f"rank {rank} sum 3 dtype torch.float32 argv ['again']" in second, second
    assert second.index("rank 0") < second.index("rank 1")  # the output rank by rank


def test_a_failed_rank_fails_the_case_and_the_next_case_runs(case_script):
    # rank 1 exits with 3; rank 0, waiting in a barrier for it, is ended by the pool, or fails by
    # itself first when gloo sees the connection reset (then its code is listed too, before or after)
    with pytest.raises(AssertionError, match=r"exit codes by rank: \{[^}]*(?<!\d)1: 3\b"):
        run_torchrun(case_script, ["fail-rank-1"], nproc=2, timeout=120)
    assert "rank 1 sum 3" in run_torchrun(case_script, ["after"], nproc=2, timeout=120)


def test_a_case_past_its_time_limit_raises_timeout(case_script, tmp_path):
    slow = tmp_path / "slow.py"
    slow.write_text("import time; time.sleep(60)\n")
    with pytest.raises(subprocess.TimeoutExpired):
        run_torchrun(str(slow), nproc=2, timeout=2)


def test_run_python_behaves_like_a_subprocess(tmp_path):
    code = "import os, sys; print(sys.argv[1:], os.getcwd()); print('to stderr', file=sys.stderr); sys.exit(5)"
    pooled = run_python(None, ["a", "b"], code=code, cwd=str(tmp_path), env=script_env())
    plain = subprocess.run([sys.executable, "-c", code, "a", "b"], cwd=str(tmp_path), env=script_env(),
                           capture_output=True, text=True)
    assert (pooled.returncode, pooled.stdout, pooled.stderr) == (plain.returncode, plain.stdout, plain.stderr) == (
        5, f"['a', 'b'] {os.path.realpath(tmp_path)}\n", "to stderr\n")
    with pytest.raises(subprocess.CalledProcessError):
        run_python(None, code=code, env=script_env(), check=True)


def test_another_environment_gets_a_pool_of_its_own():
    env = script_env()
    assert pool_for(1, env, torchrun=False) is pool_for(1, dict(env, PYTEST_CURRENT_TEST="x"), torchrun=False)
    other = dict(env, PSRL_LAUNCH_POOL_TEST="1")
    out = run_python(None, code="import os; print(os.environ.get('PSRL_LAUNCH_POOL_TEST'))", env=other)
    assert out.stdout == "1\n" and pool_for(1, other, torchrun=False) is not pool_for(1, env, torchrun=False)
