"""Loading a checkpoint runs no code from it: nothing is unpickled beyond tensors and plain
containers (``common.pt``, torch.distributed.checkpoint's ``.metadata`` index, the non-tensor
items of a ``.distcp`` shard, legacy rank files), and a planted object is one line naming the
file, exit status 2. The converter refuses HF weights holding NaN or inf unless told."""

import ast
import importlib.util
import logging
import os
import pickle
import shlex
import shutil
import sys
from pathlib import Path

import pytest
import torch
from helpers.faults import SMALL, error_line, train, without_checksums
from safetensors.torch import load_file, save_file

from megatron_psrl.checkpoint import dist_checks
from megatron_psrl.checkpoint.dist_format import load_common
from megatron_psrl.checkpoint.layout import resolve_iteration_dir
from megatron_psrl.checkpoint.loading import load_full_state_dict
from megatron_psrl.errors import CheckpointError

REPO = Path(__file__).resolve().parents[2]


class Planted:
    """What an attacker puts in a checkpoint: unpickling it runs a shell command (here one
    that creates a marker file, so the test can tell whether it ran)."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {shlex.quote(self.marker)}",)


@pytest.fixture(scope="module")
def hf_and_ckpt(tmp_path_factory):
    """A debug-llama HF folder and its torch_dist conversion."""
    from helpers.hf_reference import make_hf_checkpoint

    from megatron_psrl.checkpoint.convert import hf_to_mcore
    from megatron_psrl.model.tiny import tiny_config

    root = tmp_path_factory.mktemp("safe-loading")
    hf = make_hf_checkpoint(tiny_config("debug-llama"), directory=str(root / "hf"))
    hf_to_mcore(hf, str(root / "ckpt"), progress=False)
    return hf, str(root / "ckpt")


def _copy(ckpt: str, dst) -> str:
    shutil.copytree(ckpt, dst)
    return str(dst)


def _plant_common(it_dir: str, marker: str) -> str:
    path = os.path.join(it_dir, "common.pt")
    common = torch.load(path, weights_only=True)
    common["iteration"] = Planted(marker)
    torch.save(common, path)
    return path


def test_the_planted_object_would_run_if_unpickled(tmp_path):
    """The payload is real: plain unpickling creates the marker (so its absence below means
    the loaders refused it, not that it was harmless)."""
    marker = str(tmp_path / "ran")
    pickle.loads(pickle.dumps(Planted(marker)))
    assert os.path.exists(marker)


def test_a_planted_common_pt_is_refused_in_one_line(hf_and_ckpt, tmp_path):
    """Without checksums, megatron's load_common_state_dict used to unpickle common.pt with
    torch's default (an environment variable turns it unsafe), and the refusal was a 40-line
    traceback with exit status 1. Now common.pt is read with weights_only=True, by us, before
    megatron reads it."""
    ckpt = _copy(hf_and_ckpt[1], tmp_path / "ckpt")
    it_dir = resolve_iteration_dir(ckpt)
    without_checksums(it_dir)
    marker = str(tmp_path / "ran")
    path = _plant_common(it_dir, marker)
    for read in (lambda: load_common(it_dir), lambda: load_full_state_dict(ckpt)):
        with pytest.raises(CheckpointError) as err:
            read()
        text = str(err.value)
        assert err.value.path == path and "\n" not in text and "Traceback" not in text, text
        assert f"refused to unpickle {os.system.__module__}.system: only tensors and plain containers are loaded" \
            in text, text
    assert not os.path.exists(marker)


def test_a_planted_common_pt_is_refused_even_if_torch_is_told_to_trust_files(hf_and_ckpt, tmp_path, monkeypatch):
    """TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1 makes every torch.load that does not say
    weights_only=True unpickle anything (megatron's common.pt reader is one); ours say it."""
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    ckpt = _copy(hf_and_ckpt[1], tmp_path / "ckpt")
    it_dir = resolve_iteration_dir(ckpt)
    without_checksums(it_dir)
    marker = str(tmp_path / "ran")
    path = _plant_common(it_dir, marker)
    with pytest.raises(CheckpointError, match="refused to unpickle") as err:
        load_full_state_dict(ckpt)
    assert err.value.path == path
    assert not os.path.exists(marker)


def test_with_checksums_the_planted_file_is_a_checksum_mismatch(hf_and_ckpt, tmp_path):
    ckpt = _copy(hf_and_ckpt[1], tmp_path / "ckpt")
    marker = str(tmp_path / "ran")
    path = _plant_common(resolve_iteration_dir(ckpt), marker)
    with pytest.raises(CheckpointError, match="checksum mismatch") as err:
        load_full_state_dict(ckpt)
    assert err.value.path == path
    assert not os.path.exists(marker)


def test_a_planted_index_is_refused(hf_and_ckpt, tmp_path):
    """torch's reader pickle.loads ``.metadata`` with no restriction at all; it is read first
    with an unpickler that admits only the index's own record classes."""
    ckpt = _copy(hf_and_ckpt[1], tmp_path / "ckpt")
    it_dir = resolve_iteration_dir(ckpt)
    without_checksums(it_dir)
    marker = str(tmp_path / "ran")
    path = os.path.join(it_dir, ".metadata")
    with open(path, "rb") as f:
        index = pickle.load(f)  # the genuine index, trusted here: the test wrote it
    index.planner_data = Planted(marker)
    with open(path, "wb") as f:
        pickle.dump(index, f)
    with pytest.raises(CheckpointError) as err:
        load_full_state_dict(ckpt)
    assert err.value.path == path and f"refused to unpickle {os.system.__module__}.system" in str(err.value)
    assert not os.path.exists(marker)
    assert dist_checks.read_index(resolve_iteration_dir(hf_and_ckpt[1])).storage_data  # a genuine one reads


def _plant_module(site: Path, module: str, marker: Path) -> None:
    """A module (and for a dotted name its package) whose import appends its name to
    ``marker``: what any installed module's import-time code could do."""
    code = f"with open({str(marker)!r}, 'a') as f:\n    f.write(__name__ + '\\n')\nclass Record:\n    pass\n"
    *packages, leaf = module.split(".")
    folder = site
    for package in packages:
        folder = folder / package
        folder.mkdir(parents=True)
        (folder / "__init__.py").write_text(code)
    site.mkdir(exist_ok=True)
    (folder / f"{leaf}.py").write_text(code)


@pytest.mark.parametrize("module", ["psrl_planted_probe", "psrl_planted_package.records"])
def test_a_planted_index_imports_nothing_it_names(tmp_path, monkeypatch, module):
    """pickle's own find_class imports a global's module before an unpickler can refuse it, so
    a crafted ``.metadata`` could make the reader run any installed module's import-time code.
    The index unpickler decides from the names first: the module (and its package) is never
    imported, and the load is refused with the usual one-line error."""
    site, marker = tmp_path / "site", tmp_path / "imported"
    _plant_module(site, module, marker)
    monkeypatch.syspath_prepend(str(site))
    it_dir = tmp_path / "iter_0000001"
    it_dir.mkdir()
    index = it_dir / ".metadata"
    index.write_bytes(f"c{module}\nRecord\n(tR.".encode())  # GLOBAL module.Record, called: what the index holds
    top = module.split(".")[0]
    try:
        with pytest.raises(CheckpointError) as err:
            dist_checks.read_index(str(it_dir))
        assert err.value.path == str(index) and "\n" not in str(err.value)
        assert f"refused to unpickle {module}.Record: only torch.distributed.checkpoint's index records" \
            in str(err.value)
        assert not marker.exists() and module not in sys.modules and top not in sys.modules
        # The planted module is importable and does run code on import: its absence above is the check.
        pickle.loads(index.read_bytes())
        assert marker.read_text().split() == ([top, module] if top != module else [module])
    finally:
        for name in {module, top}:
            sys.modules.pop(name, None)


def test_the_index_unpickler_runs_no_module_getattr(tmp_path, monkeypatch):
    """An admitted module's attribute is looked up without calling the module's ``__getattr__``
    (torch's imports submodules such as torch._dynamo on first access)."""
    looked_up = []

    def lazy(name):
        looked_up.append(name)
        raise AttributeError(name)

    monkeypatch.setattr(torch, "__getattr__", lazy, raising=False)
    it_dir = tmp_path / "iter_0000001"
    it_dir.mkdir()
    (it_dir / ".metadata").write_bytes(b"ctorch\n_psrl_lazy\n.")
    with pytest.raises(CheckpointError, match="refused to unpickle torch._psrl_lazy"):
        dist_checks.read_index(str(it_dir))
    assert looked_up == []
    with pytest.raises(AttributeError):  # the patched hook is what getattr() would have run
        getattr(torch, "_psrl_lazy")
    assert looked_up == ["_psrl_lazy"]


def test_a_planted_object_item_in_the_shard_is_refused(hf_and_ckpt, tmp_path):
    """The shard's non-tensor items (``_extra_state``, megatron's RNG state) are loaded by
    torch's planner with weights_only=False; they are unpickled safely first."""
    ckpt = _copy(hf_and_ckpt[1], tmp_path / "ckpt")
    it_dir = resolve_iteration_dir(ckpt)
    without_checksums(it_dir)
    marker = str(tmp_path / "ran")
    shard, index_path = os.path.join(it_dir, "__0_0.distcp"), os.path.join(it_dir, ".metadata")
    with open(index_path, "rb") as f:
        index = pickle.load(f)
    key = next(k for k in index.storage_data if k.fqn.endswith("_extra_state/shard_0_2"))
    payload = Path(tmp_path / "payload.pt")
    torch.save([Planted(marker)], payload)
    offset = os.path.getsize(shard)
    with open(shard, "ab") as f:  # appended, and the item's record pointed at it
        f.write(payload.read_bytes())
    info = index.storage_data[key]
    index.storage_data[key] = type(info)(info.relative_path, offset, payload.stat().st_size,
                                         getattr(info, "transform_descriptors", None))
    with open(index_path, "wb") as f:
        pickle.dump(index, f)
    with pytest.raises(CheckpointError) as err:
        load_full_state_dict(ckpt)
    assert (err.value.path, err.value.tensor) == (shard, key.fqn), str(err.value)
    assert "refused to unpickle" in str(err.value) and "\n" not in str(err.value)
    assert not os.path.exists(marker)


def test_a_planted_legacy_rank_file_is_refused(hf_and_ckpt, tmp_path):
    from megatron_psrl.checkpoint.convert import hf_to_mcore

    ckpt = str(tmp_path / "legacy")
    hf_to_mcore(hf_and_ckpt[0], ckpt, progress=False, ckpt_format="legacy")
    it_dir = resolve_iteration_dir(ckpt)
    without_checksums(it_dir)
    marker = str(tmp_path / "ran")
    path = os.path.join(it_dir, "mp_rank_00", "model_optim_rng.pt")
    blob = torch.load(path, weights_only=True)
    blob["args"] = Planted(marker)
    torch.save(blob, path)
    with pytest.raises(CheckpointError, match="refused to unpickle") as err:
        load_full_state_dict(ckpt)
    assert err.value.path == path and "\n" not in str(err.value)
    assert not os.path.exists(marker)


def _calls(tree: ast.AST, module: str, attr: str):
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == attr
                and isinstance(node.func.value, ast.Name) and node.func.value.id == module):
            yield node


def test_every_torch_load_says_weights_only():
    """Every torch.load of the package and the tools passes weights_only=True explicitly (not
    torch's default, which TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD turns off), and nothing calls
    pickle.load / pickle.loads."""
    files = sorted(REPO.glob("megatron_psrl/**/*.py")) + sorted(REPO.glob("tools/*.py")) + [REPO / "pretrain_agent_rl.py"]
    loads, unsafe = 0, []
    for path in files:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for call in _calls(tree, "torch", "load"):
            loads += 1
            flag = [k.value for k in call.keywords if k.arg == "weights_only"]
            if not (flag and isinstance(flag[0], ast.Constant) and flag[0].value is True):
                unsafe.append(f"{path.relative_to(REPO)}:{call.lineno}")
        unsafe += [f"{path.relative_to(REPO)}:{c.lineno} pickle.{n}" for n in ("load", "loads")
                   for c in _calls(tree, "pickle", n)]
    assert loads >= 2 and not unsafe, unsafe


@pytest.mark.slow  # the command line in a subprocess
def test_load_of_a_planted_common_pt_exits_2(hf_and_ckpt, tmp_path):
    ckpt = _copy(hf_and_ckpt[1], tmp_path / "ckpt")
    it_dir = resolve_iteration_dir(ckpt)
    without_checksums(it_dir)
    marker = str(tmp_path / "ran")
    path = _plant_common(it_dir, marker)
    line = error_line(train(SMALL[2:] + ["--load", ckpt, "--train-iters", "1"], tmp_path, here=True))
    assert line.startswith(f"error: {path}: refused to unpickle"), line
    assert not os.path.exists(marker)


# ---------------------------------------------------------------------- non-finite HF weights
def _tool():
    spec = importlib.util.spec_from_file_location("psrl_tool_convert_safe", REPO / "tools" / "convert_hf_checkpoint.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


NAME = "model.layers.1.mlp.down_proj.weight"


def _poisoned_hf(src: str, dst) -> str:
    """A copy of ``src`` with one NaN and one inf in ``NAME``."""
    shutil.copytree(src, dst)
    files = [f for f in os.listdir(dst) if f.endswith(".safetensors")]
    for f in files:
        tensors = load_file(os.path.join(dst, f))
        if NAME in tensors:
            tensors[NAME][0, 0] = float("nan")
            tensors[NAME][1, 2] = float("inf")
            save_file(tensors, os.path.join(dst, f), metadata={"format": "pt"})
            return os.path.join(str(dst), f)
    raise AssertionError(f"{NAME} not found")


def test_the_converter_refuses_a_non_finite_weight(hf_and_ckpt, tmp_path, capfd):
    from megatron_psrl.checkpoint.convert import hf_to_mcore

    poisoned = _poisoned_hf(hf_and_ckpt[0], tmp_path / "hf")
    out = tmp_path / "ckpt"
    with pytest.raises(CheckpointError) as err:
        hf_to_mcore(str(tmp_path / "hf"), str(out), progress=False)
    assert (err.value.path, err.value.tensor) == (poisoned, NAME)
    assert "2 non-finite values (1 NaN, 1 inf)" in str(err.value) and "--allow-non-finite" in str(err.value)
    assert not out.exists()

    code = _tool().main(["hf-to-mcore", "--hf-dir", str(tmp_path / "hf"), "--out-dir", str(out), "--no-progress"])
    errors = [line for line in capfd.readouterr().err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(errors) == 1 and poisoned in errors[0] and repr(NAME) in errors[0], errors
    assert not out.exists()


def test_allow_non_finite_converts_with_one_warning(hf_and_ckpt, tmp_path, caplog):
    poisoned = _poisoned_hf(hf_and_ckpt[0], tmp_path / "hf")
    out = tmp_path / "ckpt"
    with caplog.at_level(logging.WARNING, logger="megatron_psrl"):
        code = _tool().main(["hf-to-mcore", "--hf-dir", str(tmp_path / "hf"), "--out-dir", str(out), "--no-progress",
                             "--allow-non-finite"])
    assert code == 0
    warnings = [r.getMessage() for r in caplog.records if "non-finite" in r.getMessage()]
    assert len(warnings) == 1 and poisoned in warnings[0] and repr(NAME) in warnings[0], warnings
    full = load_full_state_dict(str(out))[1]
    fc2 = full["decoder.layers.1.mlp.linear_fc2.weight"]  # down_proj, stored as is
    assert torch.isnan(fc2[0, 0]) and torch.isinf(fc2[1, 2]) and int((~torch.isfinite(fc2)).sum()) == 2
