"""The session cache of per-sample references (tests/helpers/reference_cache.py): a key is the
content of the inputs (another weight or another batch is another key), concurrent processes
asking for one key compute it once, and a hit leaves the reference's gradients in the model as
a computation would."""

import os
import subprocess
import sys
import textwrap

import numpy as np
import torch
from helpers.reference_cache import CACHE_ENV, cached, fingerprint
from helpers.torchrun import script_env


def test_a_key_is_the_content_of_the_inputs():
    model = torch.nn.Linear(3, 2)
    batch = np.arange(6)
    key = fingerprint([model, batch, (0.2, "token-mean")])
    assert fingerprint([model, batch.copy(), (0.2, "token-mean")]) == key
    with torch.no_grad():
        model.weight[0, 0] += 1e-6
    assert fingerprint([model, batch, (0.2, "token-mean")]) != key
    assert fingerprint([torch.nn.Linear(3, 2), batch[::-1], (0.2, "token-mean")]) != key
    assert fingerprint([model, batch, (0.3, "token-mean")]) != fingerprint([model, batch, (0.2, "token-mean")])


def test_processes_asking_for_one_key_compute_it_once(tmp_path):
    log = tmp_path / "computed.log"
    script = textwrap.dedent(f"""
        import time
        from helpers.reference_cache import cached

        def compute():
            with open({str(log)!r}, "a") as f:
                f.write("x")
            time.sleep(0.5)  # long enough for the others to queue on the lock
            return {{"value": 42}}

        assert cached("demo", ["same key"], compute) == {{"value": 42}}
    """)
    env = script_env()
    env[CACHE_ENV] = str(tmp_path)
    procs = [subprocess.Popen([sys.executable, "-c", script], env=env) for _ in range(3)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0, 0]
    assert log.read_text() == "x"


def test_without_a_store_every_call_computes(monkeypatch):
    monkeypatch.delenv(CACHE_ENV, raising=False)
    calls = []
    for _ in range(2):
        cached("demo", ["key"], lambda: calls.append(1))
    assert len(calls) == 2


def test_a_hit_leaves_the_reference_gradients_in_the_model(tmp_path, monkeypatch):
    from helpers.hf_reference import load_hf_model, make_hf_checkpoint, per_sample_loss_and_grads

    from megatron_psrl.data.loader import samples_from_dicts
    from megatron_psrl.model.tiny import tiny_config

    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    model = load_hf_model(make_hf_checkpoint(tiny_config("debug-llama"), directory=str(tmp_path / "hf")))
    batch = samples_from_dicts([{"tokens": [1, 2, 3, 4, 5], "advantage": 1.0},
                                {"tokens": [1, 2, 3, 7], "advantage": -0.5}], source="records")
    first_total, first = per_sample_loss_and_grads(model, batch, 0.2, 0.0, 0.0, "token-mean")
    model.zero_grad(set_to_none=True)
    again_total, again = per_sample_loss_and_grads(model, batch, 0.2, 0.0, 0.0, "token-mean")
    assert again_total == first_total
    assert len([f for f in os.listdir(tmp_path) if f.startswith("loss-and-grads-") and f.endswith(".pt")]) == 1
    for name, p in model.named_parameters():
        assert torch.equal(again[name], first[name]) and torch.equal(p.grad, first[name])


def test_a_model_with_an_altered_forward_is_never_cached(tmp_path, monkeypatch):
    """Replaying routes patches a module's forward or hooks it: the same weights then compute
    something else, so such a call computes every time (it neither stores nor reads)."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    model = torch.nn.Sequential(torch.nn.Linear(3, 2))
    calls = []
    handle = model[0].register_forward_hook(lambda *a: None)
    cached("demo", [model], lambda: calls.append(1))
    handle.remove()
    model[0].forward = lambda x: x  # a replaced forward on the instance
    cached("demo", [model], lambda: calls.append(1))
    assert len(calls) == 2 and not [f for f in os.listdir(tmp_path) if f.endswith(".pt")]
    del model[0].forward
    cached("demo", [model], lambda: calls.append(1))
    cached("demo", [model], lambda: calls.append(1))
    assert len(calls) == 3  # a plain model again: computed once, then read
