"""torch_dist checkpoints of an MoE model (debug Qwen3-MoE, 8 experts) under expert
parallelism: a checkpoint saved at EP = DP = 2 (torchrun, gloo) loads at EP = 1 (one rank, or
two ranks with DP = 2) and one saved at EP = 1 loads at EP = 2, with every rank's weights and
Adam state equal, bit for bit, to their slices of the checkpoint's global tensors (a reshard is
a copy), every expert in place; training then continues as the straight run does (up to
rounding across EP sizes, bit for bit at the same EP size). The converter writes every expert
of an EP = 2 checkpoint; the legacy format refuses expert parallelism in one line; the
optimizer-state recasting between one and two megatron optimizers, unit-tested."""

import importlib.util
import json
import os

import pytest
import torch
from helpers.dist_ckpt import plain_tensors
from helpers.families import make_family_checkpoint
from helpers.tolerance import assert_equal_up_to_rounding, rounding_tolerance
from helpers.torchrun import REPO_ROOT, SharedLaunches, selected_test_names

from megatron_psrl.checkpoint.dist_format import single_process_model_parallel
from megatron_psrl.checkpoint.expert_parallel import sub_states
from megatron_psrl.checkpoint.layout import CheckpointInfo, read_checkpoint_info
from megatron_psrl.errors import CheckpointError
from megatron_psrl.model.architecture import ModelArchitecture
from megatron_psrl.model.tiny import tiny_config

SCRIPT = os.path.join(REPO_ROOT, "tests", "checkpoint", "scripts", "moe_ep_checkpoint.py")
_spec = importlib.util.spec_from_file_location("moe_ep_checkpoint", SCRIPT)
script = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(script)
NUM_EXPERTS = 8


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return make_family_checkpoint(tiny_config("debug-qwen3-moe"), str(tmp_path_factory.mktemp("hf-qwen3-moe")))


EP2_TESTS = ("test_ep2_checkpoint_resumes_at_ep1_on_one_rank", "test_ep2_checkpoint_resumes_on_two_ranks_at_ep1",
             "test_ep2_checkpoint_resumes_at_ep2_bit_for_bit")
OTHER_FAMILIES = {  # id: (family, dtype, distributed optimizer, EP size of the save)
    "qwen2-moe-bf16-ep2-to-ep1": ("debug-qwen2-moe", "bfloat16", False, 2),  # shared expert (dense); bf16: fp32 masters
    "mixtral-distributed-optimizer-ep1-to-ep2": ("debug-mixtral", "float32", True, 1),  # fully reshardable
    # a dense first layer (megatron's per-layer moe_layer_freq: non-homogeneous layers), the fp32 expert bias
    "glm4-moe-bf16-ep2-to-ep1": ("debug-glm4-moe", "bfloat16", False, 2),
}


@pytest.fixture(scope="module")
def runs(hf_dir, tmp_path_factory, request):
    """The 2-rank runs of this module in one torchrun launch, in this order: EP = DP = 2 from
    the HF folder (``ep2/straight``), its ``ckpt-1`` resumed at EP = 1 (``ep2/at-ep1``) and at
    EP = 2 (``ep2/at-ep2``), an EP = 1 checkpoint (saved by this process first) resumed at
    EP = 2 (``ep1/at-ep2``), and the other families' runs. ``runs(case)`` runs them (the first
    time) and returns the case's folder and what this process computed for it first."""
    selected = selected_test_names(request)
    tests = {"ep2/straight": EP2_TESTS, "ep2/at-ep1": EP2_TESTS[1:2], "ep2/at-ep2": EP2_TESTS[2:],
             "ep1/at-ep2": ("test_ep1_checkpoint_resumes_at_ep2",),
             **{f"{name}/run": (f"test_other_families_and_optimizers_reshard[{name}]",) for name in OTHER_FAMILIES}}
    shared = SharedLaunches({case for case, names in tests.items() if selected.intersection(names)})
    folders = {case: tmp_path_factory.mktemp(case.replace("/", "-")) for case in tests}
    before = {}
    ep2 = folders["ep2/straight"]
    shared.add("ep2/straight", 2, SCRIPT, lambda: [
        "--source", hf_dir, "--ep", "2", "--steps", "2", "--save", str(ep2 / "ckpt"), "--legacy-probe",
        str(ep2 / "legacy"), "--out", str(ep2 / "report.json")])
    for case, ep in (("ep2/at-ep1", 1), ("ep2/at-ep2", 2)):
        shared.add(case, 2, SCRIPT, lambda d=folders[case], ep=ep: [
            "--source", str(ep2 / "ckpt-1"), "--ep", str(ep), "--steps", "1", "--check", "--save", str(d / "resumed"),
            "--out", str(d / "report.json")])

    def ep1_at_ep2(d=folders["ep1/at-ep2"]):
        before["ep1/at-ep2"] = script.run(hf_dir, ep=1, steps=2, save=str(d / "ckpt"))  # the straight EP = 1 run
        return ["--source", str(d / "ckpt-1"), "--ep", "2", "--steps", "1", "--check", "--save", str(d / "resumed"),
                "--out", str(d / "report.json")]

    shared.add("ep1/at-ep2", 2, SCRIPT, ep1_at_ep2)
    for name, (family, dtype, distributed, saved_ep) in OTHER_FAMILIES.items():
        def other(d=folders[f"{name}/run"], family=family, dtype=dtype, distributed=distributed, saved_ep=saved_ep):
            hf = make_family_checkpoint(tiny_config(family), str(d / "hf"))
            ckpt, out = str(d / "ckpt"), d / "report.json"
            flags = ["--dtype", dtype] + (["--use-distributed-optimizer"] if distributed else [])
            if saved_ep == 2:
                return ["--source", hf, "--ep", "2", "--steps", "1", "--save", ckpt, "--out", str(out)] + flags
            script.run(hf, ep=1, steps=1, save=ckpt, dtype=dtype, distributed_optimizer=distributed)
            return ["--source", ckpt, "--ep", "2", "--steps", "1", "--check", "--out", str(out)] + flags

        shared.add(f"{name}/run", 2, SCRIPT, other)

    def run(case):
        shared.check(case)
        return folders[case], before.get(case)

    return run


@pytest.fixture(scope="module")
def ep2_run(runs):
    """EP = DP = 2 under torchrun: 2 straight iterations from the HF folder, saved after each
    (``ckpt-1``, then ``ckpt``); a legacy-format save is tried at the end (refused)."""
    d, _ = runs("ep2/straight")
    return d, json.loads((d / "report.json").read_text())


def _plain(it_dir):
    with single_process_model_parallel():
        return plain_tensors(str(it_dir))


def _assert_every_expert_compared(counts, ep, per_param=2):
    """Each rank compared its E / EP experts (weights, and ``per_param`` optimizer slices per
    model slice: exp_avg, exp_avg_sq, and the fp32 master of bf16 or of the distributed
    optimizer); together, every expert."""
    per_rank = NUM_EXPERTS // ep
    seen = []
    for c in counts:
        assert c["optimizer"] == per_param * c["model"] and c["model"] > 10, c
        assert len(c["experts"]) == per_rank, c
        seen += c["experts"]
    assert sorted(set(seen)) == list(range(NUM_EXPERTS))


def _assert_continues_like(resumed_report, resumed_dir, straight_report, straight_dir, exact: bool):
    """The resumed run's second iteration equals the straight run's: the loss, and the saved
    weights and Adam moments (bit for bit at the same EP size, else up to rounding: the expert
    gradients are summed in another order)."""
    loss, expected = resumed_report["losses"][-1], straight_report["losses"][-1]
    if exact:
        assert loss == expected
    else:
        assert abs(loss - expected) <= rounding_tolerance(torch.float32, abs(expected)), (loss, expected)
    x, y = _plain(resumed_dir / "iter_0000002"), _plain(straight_dir / "iter_0000002")
    assert set(x) == set(y) and any(k.startswith("optimizer.state.exp_avg_sq.") and ".experts." in k for k in x)
    assert not any(k.startswith("chained_") for k in x)  # one key per parameter at any EP size
    for key, tensor in y.items():
        if key == "optimizer" and not exact:  # one or two megatron optimizers: the same Adam step
            steps = {float(sub["state"]["common_step"]) for sub in sub_states(x[key]) + sub_states(tensor)}
            assert steps == {2.0}, steps
        elif not torch.is_tensor(tensor):
            assert x[key] == tensor, key
        elif exact:
            assert torch.equal(x[key], tensor), key
        else:
            assert_equal_up_to_rounding(x[key], tensor, scale=float(tensor.abs().max()))


# ------------------------------------------------------------------------------- EP = 2 -> EP = 1
@pytest.mark.slow  # two processes
def test_ep2_checkpoint_resumes_at_ep1_on_one_rank(ep2_run, tmp_path):
    """Saved at EP = DP = 2, loaded by one rank (EP = 1): every weight and Adam moment of all 8
    experts is its saved value; one more iteration equals the straight EP = 2 run's second.
    The converter writes every expert of that checkpoint, equal to the loaded model's."""
    from safetensors.torch import load_file

    from megatron_psrl.checkpoint.convert import mcore_to_hf

    d, straight = ep2_run
    _, info = read_checkpoint_info(str(d / "ckpt-1"))
    assert info.expert_model_parallel_size == 2 and info.has_optimizer_state
    report = script.run(str(d / "ckpt-1"), ep=1, steps=1, save=str(tmp_path / "resumed"), check=True,
                        hf_weights=True)
    assert report["ep"] == 1 and report["start"] == 1 and report["iteration"] == 2
    _assert_every_expert_compared(report["counts"], ep=1)
    _assert_continues_like(report, tmp_path / "resumed", straight, d / "ckpt", exact=False)

    mcore_to_hf(str(d / "ckpt-1"), str(tmp_path / "hf"), progress=False)
    exported = load_file(os.path.join(tmp_path / "hf", "model.safetensors"))
    assert set(exported) == set(report["hf"])
    for layer in range(info.architecture.num_layers):
        for e in range(NUM_EXPERTS):
            assert f"model.layers.{layer}.mlp.experts.{e}.down_proj.weight" in exported
    for name, tensor in report["hf"].items():
        assert torch.equal(exported[name], tensor), name


@pytest.mark.slow
def test_ep2_checkpoint_resumes_on_two_ranks_at_ep1(ep2_run, runs):
    """Saved at EP = DP = 2, loaded by two ranks at DP = 2, EP = 1: both ranks hold all 8
    experts, equal to the saved ones with their Adam state; training continues as straight."""
    d, straight = ep2_run
    tmp_path, _ = runs("ep2/at-ep1")  # --source ckpt-1 --ep 1 --steps 1 --check --save resumed
    out = tmp_path / "report.json"
    report = json.loads(out.read_text())
    assert report["world"] == 2 and report["ep"] == 1
    for counts in report["counts"]:  # DP replicas: each rank compares every expert
        _assert_every_expert_compared([counts], ep=1)
    _assert_continues_like(report, tmp_path / "resumed", straight, d / "ckpt", exact=False)


@pytest.mark.slow
def test_ep2_checkpoint_resumes_at_ep2_bit_for_bit(ep2_run, runs):
    """At the same EP size, 1 + 1 iterations with a save and load between equal 2 straight ones
    bit for bit (loss, weights, Adam state); a legacy-format save at EP = 2 was refused."""
    d, straight = ep2_run
    tmp_path, _ = runs("ep2/at-ep2")  # --source ckpt-1 --ep 2 --steps 1 --check --save resumed
    out = tmp_path / "report.json"
    report = json.loads(out.read_text())
    _assert_every_expert_compared(report["counts"], ep=2)
    _assert_continues_like(report, tmp_path / "resumed", straight, d / "ckpt", exact=True)
    refusal = straight["legacy_refusal"]
    assert str(d / "legacy") in refusal and "expert-parallel size 2" in refusal and "torch_dist" in refusal
    assert "\n" not in refusal and not (d / "legacy").exists()


# ------------------------------------------------------------------------------- EP = 1 -> EP = 2
@pytest.mark.slow
def test_ep1_checkpoint_resumes_at_ep2(runs):
    """Saved by one rank (EP = 1, one megatron optimizer), loaded at EP = DP = 2 (a dense and an
    expert optimizer): each rank's 4 experts and the dense weights with their Adam state are
    the saved ones; training continues as the straight EP = 1 run."""
    # the straight EP = 1 run (2 iterations, saved after each) ran here before the launch
    tmp_path, straight = runs("ep1/at-ep2")
    _, info = read_checkpoint_info(str(tmp_path / "ckpt-1"))
    assert info.expert_model_parallel_size == 1
    out = tmp_path / "report.json"
    report = json.loads(out.read_text())
    assert report["ep"] == 2 and report["start"] == 1
    _assert_every_expert_compared(report["counts"], ep=2)
    _assert_continues_like(report, tmp_path / "resumed", straight, tmp_path / "ckpt", exact=False)


@pytest.mark.slow
@pytest.mark.parametrize("family,dtype,distributed,saved_ep", list(OTHER_FAMILIES.values()), ids=list(OTHER_FAMILIES))
def test_other_families_and_optimizers_reshard(family, dtype, distributed, saved_ep, runs, request):
    """Qwen2-MoE and GLM-4.5 in bf16 saved at EP = 2 load at EP = 1; Mixtral with the distributed
    optimizer saved at EP = 1 loads at EP = 2: every expert's weights and optimizer state bit for
    bit."""
    # EP = 2 saves under torchrun; EP = 1 saved here first, then checked at EP = 2 under torchrun
    tmp_path, _ = runs(f"{request.node.callspec.id}/run")
    ckpt, out = str(tmp_path / "ckpt"), tmp_path / "report.json"
    if saved_ep == 2:
        report = script.run(ckpt, ep=1, steps=1, check=True, dtype=dtype, distributed_optimizer=distributed)
    else:
        report = json.loads(out.read_text())
    assert report["ep"] == 3 - saved_ep and report["iteration"] == 2
    _assert_every_expert_compared(report["counts"], ep=3 - saved_ep, per_param=3)
    assert all(abs(loss) < 10 for loss in report["losses"])


# ------------------------------------------------------------------------------- units
def _sharded(key, n=2):
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    return ShardedTensor.from_rank_offsets(key, torch.zeros(n))


def _group(expert, wd=1.0, lr=1e-3):
    return {"lr": lr, "betas": (0.9, 0.999), "wd_mult": wd, "lr_mult": 1.0, "is_expert_parallel": expert,
            "is_decoupled_lr": False}


def _request(groups, keys):
    """What a torch-Adam megatron optimizer requests when loading (params local-only)."""
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject

    return {"state": {i: {"exp_avg": _sharded(k)} for i, k in enumerate(keys)},
            "param_groups": [dict(g, params=LocalNonpersistentObject([0])) for g in groups]}


def test_optimizer_state_recast_between_one_and_two_optimizers():
    from megatron_psrl.checkpoint.expert_parallel import match_stored_keys, recast_common, strip_chained_prefixes

    step = torch.tensor(3.0)
    single = {"state": {"common_step": step}, "param_groups": [_group(False, lr=0.5), _group(False, wd=0.0)]}
    chained = {0: {"state": {"common_step": step}, "param_groups": [_group(False, lr=0.5), _group(False, wd=0.0)]},
               1: {"state": {"common_step": step}, "param_groups": [_group(True, lr=0.5)]}}
    assert sub_states(chained) == [chained[0], chained[1]] and sub_states(single) == [single]

    # EP = 1 saved, EP = 2 loads: the expert optimizer's group is the saved dense one, marked expert
    wanted = {0: _request([_group(False), _group(False, wd=0.0)], ["a", "b"]), 1: _request([_group(True)], ["e"])}
    recast = recast_common(single, wanted, "/ckpt/iter_0000001")
    assert sorted(recast) == [0, 1] and recast[1]["state"]["common_step"] == 3.0
    assert recast[1]["param_groups"] == [dict(_group(True), lr=0.5)]  # the saved values, this run's EP flag
    assert [g["wd_mult"] for g in recast[0]["param_groups"]] == [1.0, 0.0]

    # EP = 2 saved, EP = 1 loads: one optimizer, the dense groups, the common step
    recast = recast_common(chained, _request([_group(False), _group(False, wd=0.0)], ["a", "b"]), "/ckpt")
    assert recast["state"] == {"common_step": step} and recast["param_groups"][0]["lr"] == 0.5
    assert recast_common(chained, wanted, "/ckpt") is chained  # the same structure: as saved

    # a group the checkpoint has no counterpart of: one line naming the folder
    with pytest.raises(CheckpointError, match=r"^/ckpt: holds no optimizer parameter group like this run's"):
        recast_common(chained, _request([_group(False, wd=0.5)], ["a"]), "/ckpt")

    # megatron's chained prefixes: dropped on save; an older checkpoint's found on load
    state = {0: {"x": _sharded("chained_0.optimizer.state.exp_avg.a")},
             1: {"x": _sharded("chained_1.optimizer.state.exp_avg.e")}}
    strip_chained_prefixes(state)
    assert [state[0]["x"].key, state[1]["x"].key] == ["optimizer.state.exp_avg.a", "optimizer.state.exp_avg.e"]
    match_stored_keys(state, {"chained_0.optimizer.state.exp_avg.a", "optimizer.state.exp_avg.e"})
    assert [state[0]["x"].key, state[1]["x"].key] == ["chained_0.optimizer.state.exp_avg.a",
                                                      "optimizer.state.exp_avg.e"]


def test_expert_parallel_size_in_psrl_model_json():
    arch = ModelArchitecture.from_hf_config(tiny_config("debug-qwen3-moe"))
    info = CheckpointInfo(arch, 1, 1, 3, "float32", has_optimizer_state=True, expert_model_parallel_size=2)
    assert json.loads(info.to_json())["expert_model_parallel_size"] == 2
    assert CheckpointInfo.from_json(info.to_json(), "x").expert_model_parallel_size == 2
    plain = CheckpointInfo(arch, 1, 1, 3, "float32")
    assert "expert_model_parallel_size" not in json.loads(plain.to_json())  # as before for EP = 1
    assert CheckpointInfo.from_json(plain.to_json(), "x").expert_model_parallel_size == 1


def test_legacy_shards_split_by_expert_parallel_rank_or_refused():
    """A legacy shard holds every expert by its global index: EP rank 1 of 2 takes experts 4-7
    renumbered from 0; a shard holding one rank's experts only is refused in one line."""
    from megatron_psrl.checkpoint.loading import legacy_experts
    from megatron_psrl.model.adapters import get_adapter

    arch = ModelArchitecture.from_hf_config(tiny_config("debug-qwen3-moe"))
    shapes = get_adapter(arch).hf_shapes()
    full = dict(get_adapter(arch).hf_to_mcore(lambda n: torch.randn(shapes[n])))
    info = CheckpointInfo(arch, 1, 1, 0, "float32")
    mine = legacy_experts("/ckpt", info, full, ep_rank=1, ep=2)
    name = "decoder.layers.0.mlp.experts.local_experts.{}.linear_fc1.weight"
    assert torch.equal(mine[name.format(0)], full[name.format(4)]) and name.format(4) not in mine
    assert legacy_experts("/ckpt", info, full, 0, 1) is full
    partial = {k: v for k, v in full.items() if ".local_experts." not in k or int(k.split(".")[6]) < 4}
    with pytest.raises(CheckpointError) as err:
        legacy_experts("/ckpt", info, partial, 0, 1)
    text = str(err.value)
    assert text.startswith("/ckpt: holds 4 of the model's 8 experts in decoder.layers.0") and "\n" not in text
    assert "written with expert parallelism" in text and "expert-parallel size 1" in text
