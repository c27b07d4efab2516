"""Smoke test of ``memory_gpu_arithmetic.py --memory-budget`` on its small workload (Qwen2.5-7B
shape, TP 4, arithmetic only): every row's claims agree with each other. A chosen plan's
predicted peak fits the budget (the device less the headroom) and is above the static memory,
its time is never below keeping everything, and a tighter budget recomputes more; a budget
the static memory alone fills is refused with a smallest budget above it."""

import importlib.util
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEVICES = (22, 27, 40)  # GiB: the static memory (21.3 GiB) alone does not fit; recomputation; everything kept


def _script():
    spec = importlib.util.spec_from_file_location("memory_gpu_arithmetic",
                                                  os.path.join(ROOT, "benchmarks", "memory_gpu_arithmetic.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rows(text):
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 11 and cells[3].endswith(" GiB") and cells[0] != "model":
            rows[float(cells[3].split()[0])] = cells
    return rows


def test_memory_budget_rows_are_consistent(capsys):
    script = _script()
    script.main(["--memory-budget", "--models", "7B", "--workloads", "smoke", "--tp", "4", "--micro-batch-tokens",
                 "2048", "--devices", ",".join(map(str, DEVICES))])
    rows = _rows(capsys.readouterr().out)
    assert sorted(rows) == sorted(DEVICES)
    budget = {d: d * (1 - script.DEFAULT_HEADROOM_FRACTION) for d in DEVICES}
    static = float(rows[22][4])
    refused = re.fullmatch(r"does not fit: smallest budget ([\d.]+)", rows[22][5])
    assert refused and float(refused[1]) > budget[22] and float(refused[1]) > static
    recomputed = {}
    for d in DEVICES[1:]:
        lever, peak, ratio = rows[d][5], float(rows[d][6]), float(rows[d][7])
        assert float(rows[d][4]) == static < peak <= budget[d], rows[d]
        assert ratio >= 1.0, rows[d]
        recomputed[d] = int(re.search(r"(\d+) layers recomputed", lever)[1])
    assert recomputed[27] > recomputed[40] == 0
    assert float(rows[40][7]) == 1.0  # (everything kept: the fastest plan)


def test_static_memory_shards_experts_and_optimizer():
    script = _script()
    arch = script.architecture("qwen3-30b-a3b")
    dense, experts = script.parameter_split(arch)
    assert dense + experts == arch.num_parameters() and experts > 10 * dense
    static, ep = script.node_static(arch, 2, distributed_optimizer=True)
    assert ep == 4  # (experts over the 8 / TP data-parallel ranks)
    params = -(-dense // 2) + experts // 4
    assert (static.weights, static.gradients) == (2 * params, 4 * params)
    assert static.optimizer_state == -(-12 * params // 4)  # (fp32 moments and master weights, sharded over DP)
