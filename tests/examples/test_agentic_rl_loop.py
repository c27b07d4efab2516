"""examples/agentic_rl_loop.py as the README runs it (defaults: 40 iterations): the closed RL loop
learns with prefix sharing on and off, and the two runs agree in what holds on any machine."""

import json
import os

import pytest
from helpers.launch_pool import run_python
from helpers.torchrun import REPO_ROOT, script_env

pytestmark = pytest.mark.slow  # a closed RL loop in a subprocess

EXAMPLE = os.path.join(REPO_ROOT, "examples", "agentic_rl_loop.py")
ITERATIONS = 40  # the README's length (the example's default)


def test_the_readme_claims_at_the_readme_length(tmp_path):
    out = tmp_path / "loop.json"
    proc = run_python(EXAMPLE, ["--json", str(out)], timeout=900, env=script_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]  # 1: a check failed
    result = json.loads(out.read_text())
    shared, plain, summary = result["shared"], result["none"], result["summary"]
    assert len(shared["reward"]) == len(plain["reward"]) == ITERATIONS
    # The first step: the same rollouts; loss, gradient norm and trained log-probs within 128
    # float32 ulps (the summation-order bound the example derives).
    assert shared["rollout"][0] == plain["rollout"][0]
    assert summary["first_step_agrees"] and summary["first_step_ulps"] <= 128, summary
    # The same rollouts, so the same rewards, at every iteration starting within rounding.
    within = summary["weights_within_rounding"]
    assert within >= 1 and shared["rollout"][:within] == plain["rollout"][:within], summary
    assert shared["reward"][:within] == plain["reward"][:within]  # the same sampled tokens: equal rewards
    # Both runs learn: the last 5 iterations' mean reward at least 0.2 above the first 5's.
    for run in (shared, plain):
        assert sum(run["reward"][-5:]) / 5 >= sum(run["reward"][:5]) / 5 + 0.2, run["reward"]
    # After the 40 steps the weights differ by at most lr x iterations (1e-3 x 40).
    assert summary["max_weight_diff"] <= 1e-3 * ITERATIONS, summary
    assert summary["checks_pass"]
    for line in ("first step:", "the same rollouts, so the same reward", "both runs learn", "the weights differ",
                 "update phase"):
        assert line in proc.stdout, line
