"""The launch scripts as operators run them: two torchrun agents meeting through c10d on this
machine train like one agent with two processes; a worker killed mid-run is restarted by
torchrun and the run resumes from its latest checkpoint to the same losses; the Slurm script
runs the commands it should (checked with stub srun / scontrol)."""

import json
import os
import signal
import subprocess
import time
import uuid

import pytest
from helpers.torchrun import REPO_ROOT, free_port, run_torchrun, script_env, worker_pids

pytestmark = pytest.mark.slow  # torchrun agents and restarts

LAUNCH = os.path.join(REPO_ROOT, "launch")
COMMON = dict(DEVICE="cpu", MODEL="debug-llama", DATA="grpo", MICRO_BATCH_TOKENS="512", KV_BUDGET="64MiB",
              LR="1e-3", DIST_TIMEOUT_MINUTES="2")


def _env(**knobs):
    env = script_env()
    env.update(COMMON)
    env.update({k: str(v) for k, v in knobs.items()})
    return env


def _losses(path):
    """{iteration: loss} of a --log-json file (a restarted run repeats iterations: the last wins)."""
    out = {}
    for line in open(path):
        rec = json.loads(line)
        out[rec["iter"]] = rec["loss"]
    return out


_REFERENCES = {}


def _train_args(**knobs):
    """The ``pretrain_agent_rl.py`` arguments the launch scripts build from ``knobs``
    (launch/common.sh's TRAIN_ARGS)."""
    proc = subprocess.run(["bash", "-c", 'source launch/common.sh && printf "%s\\n" "${TRAIN_ARGS[@]}"'],
                          cwd=REPO_ROOT, env=_env(**knobs), capture_output=True, text=True, check=True)
    return proc.stdout.splitlines()


def _single_node(tmp_path, name, **knobs):
    """{iteration: loss} of an uninterrupted run of NPROC ranks (2 unless given) with the
    arguments the launch scripts build from ``knobs``; one run per set of knobs in this module
    (the tests of the same run share it). It runs in the session's launch pool: what is checked
    against it is the launch scripts' own restarts and rendezvous, not this run's launch."""
    key = tuple(sorted((k, str(v)) for k, v in knobs.items()))
    if key not in _REFERENCES:
        log = tmp_path / f"{name}.jsonl"
        nproc = int(knobs.pop("NPROC", 2))
        run_torchrun(os.path.join(REPO_ROOT, "pretrain_agent_rl.py"), _train_args(LOG_JSON=log, **knobs),
                     nproc=nproc, timeout=600)
        _REFERENCES[key] = _losses(log)
    return _REFERENCES[key]


ITERS = 4  # of the two-rank runs: the agents' and the restarted one share their reference


@pytest.mark.parametrize("tp", [1, 2], ids=["dp2", "tp2"])
def test_two_agents_over_c10d_train_like_one_agent(tmp_path, tp):
    iters = ITERS
    reference = _single_node(tmp_path, "one-agent", TP=tp, TRAIN_ITERS=iters)
    log = tmp_path / "two-agents.jsonl"
    env = _env(NNODES=2, NPROC=1, TP=tp, TRAIN_ITERS=iters, MASTER_ADDR="127.0.0.1", MASTER_PORT=free_port(),
               RUN_ID=uuid.uuid4().hex, LOG_JSON=log)
    agents = [subprocess.Popen(["bash", os.path.join(LAUNCH, "torchrun_multi_node.sh")], cwd=REPO_ROOT, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outputs = [a.communicate(timeout=600) for a in agents]
    for agent, (_, err) in zip(agents, outputs):
        assert agent.returncode == 0, err[-4000:]
    two = _losses(log)
    assert sorted(two) == list(range(1, iters + 1))
    for it, loss in reference.items():
        assert two[it] == pytest.approx(loss, rel=1e-6, abs=1e-9), (it, two, reference)


def test_killed_worker_is_restarted_and_resumes_from_the_checkpoint(tmp_path):
    iters, interval = ITERS, 2
    reference = _single_node(tmp_path, "uninterrupted", TP=1, TRAIN_ITERS=iters)
    save = tmp_path / "ckpt"
    log = tmp_path / "restarted.jsonl"
    env = _env(NPROC=2, TRAIN_ITERS=iters, SAVE=save, SAVE_INTERVAL=interval, MAX_RESTARTS=1, LOG_JSON=log,
               EXTRA_ARGS="--log-interval 1")
    agent = subprocess.Popen(["bash", os.path.join(LAUNCH, "torchrun_single_node.sh")], cwd=REPO_ROOT, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        tracker = save / "latest_checkpointed_iteration.txt"
        deadline = time.time() + 300
        while not (tracker.exists() and int(tracker.read_text().strip() or 0) >= interval):
            assert time.time() < deadline and agent.poll() is None, "no checkpoint appeared"
            time.sleep(0.1)
        # bash exec'd torchrun: the agent is the process we started
        victim = worker_pids(agent.pid)[1]
        os.kill(victim, signal.SIGKILL)
        out, err = agent.communicate(timeout=600)
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
    assert agent.returncode == 0, err[-4000:]
    assert "resuming from" in out  # the restarted group loaded the checkpoint
    iterations = [json.loads(line)["iter"] for line in open(log)]
    # resumed, not restarted from scratch: iteration 1 ran once, every iteration ran, the last once
    assert iterations.count(1) == 1 and iterations.count(iters) == 1 and set(iterations) == set(range(1, iters + 1))
    restarted = _losses(log)
    assert sorted(restarted) == list(range(1, iters + 1))
    for it, loss in reference.items():
        assert restarted[it] == pytest.approx(loss, rel=1e-6, abs=1e-9), (it, restarted, reference)
    assert open(save / "latest_checkpointed_iteration.txt").read().strip() == str(iters)


def test_a_tree_split_across_two_nodes_resumes_after_a_killed_worker(tmp_path):
    """Two torchrun agents of 2 ranks each (two "nodes" meeting through c10d on localhost),
    trees split over all four data-parallel ranks (``--placement cross-rank``: prefix K/V and
    their gradients cross the node boundary); a worker of the second node is killed after the
    first checkpoint, every agent restarts its workers (``--max-restarts``), the run resumes
    from the checkpoint and ends with the losses of an uninterrupted single-agent run of 4 ranks."""
    iters, interval = 4, 2
    knobs = dict(DATA="tree", MICRO_BATCH_TOKENS="128", TRAIN_ITERS=iters,
                 EXTRA_ARGS="--placement cross-rank --log-interval 1")
    reference = _single_node(tmp_path, "one-agent-4", **dict(knobs, NPROC=4))
    save = tmp_path / "ckpt"
    log = tmp_path / "two-nodes.jsonl"
    env = _env(NNODES=2, NPROC=2, MASTER_ADDR="127.0.0.1", MASTER_PORT=free_port(), RUN_ID=uuid.uuid4().hex,
               SAVE=save, SAVE_INTERVAL=interval, MAX_RESTARTS=1, LOG_JSON=log, **knobs)
    agents = [subprocess.Popen(["bash", os.path.join(LAUNCH, "torchrun_multi_node.sh")], cwd=REPO_ROOT, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        tracker = save / "latest_checkpointed_iteration.txt"
        deadline = time.time() + 600
        while not (tracker.exists() and int(tracker.read_text().strip() or 0) >= interval):
            assert time.time() < deadline and all(a.poll() is None for a in agents), "no checkpoint appeared"
            time.sleep(0.1)
        # the node whose workers hold global ranks 2 and 3 (node ranks come from the rendezvous)
        second = next(a for a in agents if any(_global_rank(pid) >= 2 for pid in worker_pids(a.pid).values()))
        os.kill(sorted(worker_pids(second.pid).values())[0], signal.SIGKILL)
        outputs = [a.communicate(timeout=900) for a in agents]
    finally:
        for a in agents:
            if a.poll() is None:
                a.kill()
                a.wait()
    for i, (out, err) in enumerate(outputs):
        (tmp_path / f"agent{i}.out").write_text(out + "\n----- stderr\n" + err)
    for agent, (_, err) in zip(agents, outputs):
        assert agent.returncode == 0, "\n=====\n".join(e[-3000:] for _, e in outputs)
    assert any("resuming from" in out for out, _ in outputs)
    records = [json.loads(line) for line in open(log)]
    assert all(r["placement"] == "cross-rank" and r["exchanged_bytes"] > 0 for r in records), records[0]
    iterations = [r["iter"] for r in records]
    assert iterations.count(1) == 1 and set(iterations) == set(range(1, iters + 1))  # resumed, not restarted
    resumed = _losses(log)
    for it, loss in reference.items():
        # another process layout, the same plan: equal up to fp32 reassociation in the reductions
        assert resumed[it] == pytest.approx(loss, rel=1e-5, abs=1e-8), (it, resumed, reference)


def test_two_agents_restart_after_a_worker_dies_before_it_joins(tmp_path):
    """Two agents of one rank each ("two nodes"); rank 1 is stopped as soon as it starts (before
    it has imported torch, let alone joined the store), rank 0 joins and waits for it, then
    rank 1 is killed. Its agent restarts, the other agent restarts its healthy worker because
    the first one rejoined, and the restarted group must meet and train to the end: a death
    before joining must not leave the nodes disagreeing on the keys the group meets under."""
    iters = 2
    log = tmp_path / "two-agents.jsonl"
    env = _env(NNODES=2, NPROC=1, MASTER_ADDR="127.0.0.1", MASTER_PORT=free_port(), RUN_ID=uuid.uuid4().hex,
               TRAIN_ITERS=iters, MAX_RESTARTS=1, LOG_JSON=log)
    agents = [subprocess.Popen(["bash", os.path.join(LAUNCH, "torchrun_multi_node.sh")], cwd=REPO_ROOT, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        victim = _workers(agents, {1})[1]
        os.kill(victim, signal.SIGSTOP)
        assert _sockets(victim) == 0, "rank 1 connected before it was stopped"
        _wait_until_waiting(_workers(agents, {0}).values(), deadline=time.time() + 240)
        assert _sockets(victim) == 0  # stopped: still not joined when it dies
        os.kill(victim, signal.SIGKILL)
        try:
            outputs = [a.communicate(timeout=300) for a in agents]
        except subprocess.TimeoutExpired:
            pytest.fail("the restarted group never met (or never finished) within 300 s")
    finally:
        for a in agents:
            if a.poll() is None:
                a.kill()
                a.wait()
    for agent in agents:
        assert agent.returncode == 0, "\n=====\n".join(e[-3000:] for _, e in outputs)
    # the first group never reached an iteration; the restarted one ran each exactly once
    assert [json.loads(line)["iter"] for line in open(log)] == list(range(1, iters + 1))


def _workers(agents, ranks: set, timeout: float = 120) -> dict:
    """``{rank: pid}`` of the agents' workers of ``ranks``, once they all run (polled every
    10 ms, so a worker is seen within milliseconds of its start)."""
    deadline = time.time() + timeout
    while True:
        workers = {r: pid for a in agents for r, pid in worker_pids(a.pid).items() if r in ranks}
        if len(workers) == len(ranks):
            return workers
        assert time.time() < deadline and all(a.poll() is None for a in agents), f"only workers {sorted(workers)}"
        time.sleep(0.01)


def _sockets(pid: int) -> int:
    """Sockets a process holds open: none before its first connection to torchrun's store (the
    workers inherit no descriptors but stdin, stdout and stderr)."""
    count = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            count += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")
        except OSError:  # closed since the listing
            pass
    return count


def _cpu_ticks(pid: int) -> int:
    """User + system CPU time of a process (clock ticks, /proc/PID/stat fields 14 and 15)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def _wait_until_waiting(pids, deadline: float, quiet_s: float = 1.5) -> None:
    """Until every process has connected to the store and used no CPU for ``quiet_s`` seconds:
    done importing and setting up, and waiting for the missing rank to join."""
    pids = list(pids)
    while True:
        before = [_cpu_ticks(p) for p in pids]
        time.sleep(quiet_s)
        if all(_sockets(p) > 0 for p in pids) and [_cpu_ticks(p) for p in pids] == before:
            return
        assert time.time() < deadline, "the other workers never blocked waiting for the stopped one"


def _global_rank(pid: int) -> int:
    """The RANK torchrun gave a worker process (from its environment)."""
    with open(f"/proc/{pid}/environ", "rb") as f:
        env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
    return int(env.get(b"RANK", b"-1"))


STUB_SRUN = """#!/usr/bin/env bash
# Records its arguments, then runs the command once per node as Slurm would.
echo "srun $*" >> "$STUB_LOG"
while [[ "$1" == --* ]]; do shift; done
for node in $(seq 0 $((SLURM_NNODES - 1))); do
  SLURM_NODEID=$node SLURM_PROCID=$node "$@"
done
"""
STUB_SCONTROL = """#!/usr/bin/env bash
echo "scontrol $*" >> "$STUB_LOG"
[[ "$1 $2" == "show hostnames" ]] && printf 'gpu-node-07\\ngpu-node-08\\n'
"""
STUB_TORCHRUN = """#!/usr/bin/env bash
echo "torchrun $* | MASTER_ADDR=$MASTER_ADDR NNODES=$NNODES" >> "$STUB_LOG"
"""


def test_slurm_script_runs_one_agent_per_node_meeting_at_the_first_node(tmp_path):
    stubs = tmp_path / "bin"
    stubs.mkdir()
    for name, text in (("srun", STUB_SRUN), ("scontrol", STUB_SCONTROL), ("torchrun", STUB_TORCHRUN)):
        (stubs / name).write_text(text)
        (stubs / name).chmod(0o755)
    log = tmp_path / "commands.txt"
    env = _env(STUB_LOG=log, SLURM_JOB_NODELIST="gpu-node-[07-08]", SLURM_NNODES=2, SLURM_JOB_ID=4242, NPROC=8, TP=4,
               SAVE="/ckpt/run1", HF_DIR="/models/qwen")
    for inherited in ("MASTER_ADDR", "MASTER_PORT", "RUN_ID", "LOAD", "MODEL"):  # e.g. CI running inside Slurm
        env.pop(inherited, None)
    env["PATH"] = f"{stubs}{os.pathsep}{env['PATH']}"
    proc = subprocess.run(["bash", os.path.join(LAUNCH, "slurm.sbatch")], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = log.read_text().splitlines()
    assert lines[0] == "scontrol show hostnames gpu-node-[07-08]"
    assert lines[1] == "srun --kill-on-bad-exit=1 bash launch/torchrun_multi_node.sh"
    agents = [line for line in lines if line.startswith("torchrun ")]
    assert len(agents) == 2  # one agent per node
    for line in agents:
        assert "--nnodes 2 --nproc_per_node 8" in line
        assert "--rdzv-backend c10d --rdzv-endpoint gpu-node-07:29500 --rdzv-id 4242" in line
        assert "pretrain_agent_rl.py --hf-dir /models/qwen --load /ckpt/run1" in line  # restarts resume
        assert "--save /ckpt/run1" in line and "--tensor-model-parallel-size 4" in line
        assert line.endswith("MASTER_ADDR=gpu-node-07 NNODES=2")
