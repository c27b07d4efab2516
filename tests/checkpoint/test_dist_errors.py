"""A damaged torch_dist folder that no checksum list guards (written before checksums existed,
or loaded with ``--no-verify-checksums``) is still one line naming the shard and what is wrong,
never megatron's traceback text inside the line, and the command lines exit with status 2:
the ``.metadata`` index is checked against the files before megatron reads them, and what
megatron's reader still raises is translated (megatron_psrl/checkpoint/dist_checks.py)."""

import os
import shutil

import pytest
import torch
from helpers.faults import SMALL, empty_file, error_line, flip_bytes, tool, train, truncate_half, without_checksums

from megatron_psrl import ActorConfig, PolicyActor
from megatron_psrl.checkpoint import dist_checks
from megatron_psrl.checkpoint.checksums import VERIFY_ENV
from megatron_psrl.checkpoint.layout import resolve_iteration_dir
from megatron_psrl.checkpoint.loading import load_full_state_dict
from megatron_psrl.errors import CheckpointError


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """A debug-llama HF model converted to torch_dist (one shard, __0_0.distcp), and its tensors."""
    from helpers.hf_reference import make_hf_checkpoint

    from megatron_psrl.checkpoint.convert import hf_to_mcore
    from megatron_psrl.model.tiny import tiny_config

    root = tmp_path_factory.mktemp("dist-errors")
    hf = make_hf_checkpoint(tiny_config("debug-llama"), directory=str(root / "hf"))
    hf_to_mcore(hf, str(root / "ckpt"), progress=False)
    return str(root / "ckpt"), load_full_state_dict(str(root / "ckpt"))[1]


def _copy(ckpt: str, dst) -> str:
    shutil.copytree(ckpt, dst)
    return str(dst)


def _shard(ckpt: str) -> str:
    return os.path.join(resolve_iteration_dir(ckpt), "__0_0.distcp")


def _wider_model(path):
    """psrl_model.json says hidden size 96 while the shards hold 64."""
    model_json = os.path.join(os.path.dirname(path), "psrl_model.json")
    text = open(model_json).read()
    assert '"hidden_size": 64' in text
    open(model_json, "w").write(text.replace('"hidden_size": 64', '"hidden_size": 96'))


FAULTS = {  # what is done to the shard, and words the line must hold
    "flipped": (flip_bytes, ["CRC-32", "corrupt", "tensor '"]),
    "truncated": (truncate_half, ["truncated", ".metadata"]),
    "empty": (empty_file, ["empty file (0 bytes)"]),
    "deleted": (os.remove, ["missing"]),
    "wider-model": (_wider_model, ["shape", "(2, 64)", "(2, 96)", "tensor 'decoder."]),
}


def _assert_one_line(err: CheckpointError, shard: str, words) -> None:
    text = str(err)
    assert "\n" not in text and "Traceback" not in text and "RANK" not in text, text
    assert err.path == shard and text.startswith(shard + ": "), text
    for w in words:
        assert w in text, (w, text)


@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_damaged_shard_without_checksums_is_one_line_naming_it(converted, fault, tmp_path):
    """Each row of the issue's table, through both readers: the converter's whole-model read and
    the model a training run loads with --load. On the old code the truncated, empty, deleted and
    wider-model rows were megatron's CheckpointException with a traceback inside the line naming
    only the folder, and the flipped shard loaded silently."""
    ckpt = _copy(converted[0], tmp_path / "ckpt")
    shard = _shard(ckpt)
    hurt, words = FAULTS[fault]
    hurt(shard)
    without_checksums(resolve_iteration_dir(ckpt))
    with pytest.raises(CheckpointError) as err:
        load_full_state_dict(ckpt)
    _assert_one_line(err.value, shard, words)
    with pytest.raises(CheckpointError) as err:
        PolicyActor(ckpt, ActorConfig(device="cpu"))
    _assert_one_line(err.value, shard, words)


def test_the_crc_check_names_the_corrupt_tensor(converted, tmp_path):
    """The CRC-32 pass reports the tensor whose bytes changed, and the one at the place of the
    change: flipping bytes inside one record names that record."""
    ckpt = _copy(converted[0], tmp_path / "ckpt")
    it_dir = resolve_iteration_dir(ckpt)
    without_checksums(it_dir)
    index = dist_checks.read_index(it_dir)
    key, info = next((k, v) for k, v in index.storage_data.items() if k.fqn == "output_layer.weight")
    with open(_shard(ckpt), "r+b") as f:  # one byte in the last quarter of the record: its data
        f.seek(info.offset + info.length * 3 // 4)
        b = f.read(1)
        f.seek(info.offset + info.length * 3 // 4)
        f.write(bytes([b[0] ^ 0x01]))
    with pytest.raises(CheckpointError, match="CRC-32") as err:
        load_full_state_dict(ckpt)
    assert err.value.tensor == "output_layer.weight" and err.value.path == _shard(ckpt)


def test_with_verification_off_only_the_index_checks_run(converted, tmp_path, monkeypatch):
    """--no-verify-checksums reads nothing twice: a short shard is still named (its length is
    checked against the index), but bytes flipped inside tensor data cannot be told without the
    checksums or the CRC pass, and load as they are (the documented cost of turning it off)."""
    monkeypatch.setenv(VERIFY_ENV, "0")
    ckpt = _copy(converted[0], tmp_path / "short")
    truncate_half(_shard(ckpt))
    with pytest.raises(CheckpointError, match="truncated") as err:
        load_full_state_dict(ckpt)
    assert err.value.path == _shard(ckpt)

    ckpt = _copy(converted[0], tmp_path / "flipped")
    flip_bytes(_shard(ckpt))
    loaded = load_full_state_dict(ckpt)[1]
    changed = [k for k in loaded if not torch.equal(loaded[k], converted[1][k])]
    assert changed, "the flip did not land in tensor data"


def test_a_damaged_index_is_named(converted, tmp_path):
    ckpt = _copy(converted[0], tmp_path / "ckpt")
    it_dir = resolve_iteration_dir(ckpt)
    without_checksums(it_dir)
    index = os.path.join(it_dir, ".metadata")
    truncate_half(index)
    with pytest.raises(CheckpointError, match="truncated or corrupt") as err:
        load_full_state_dict(ckpt)
    assert err.value.path == index and "\n" not in str(err.value)
    os.remove(index)
    with pytest.raises(CheckpointError, match="missing") as err:
        load_full_state_dict(ckpt)
    assert err.value.path == index


def test_megatron_failures_are_translated_without_traceback_text(converted, tmp_path):
    """What megatron's reader raises after the checks (torch's CheckpointException carrying each
    rank's exception and traceback) becomes one line naming the file and the tensor."""
    from megatron.core.dist_checkpointing.core import CheckpointingException
    from torch.distributed.checkpoint import CheckpointException

    it_dir = resolve_iteration_dir(converted[0])
    index = dist_checks.read_index(it_dir)
    shard = os.path.join(it_dir, "__0_0.distcp")
    try:
        raise EOFError()
    except EOFError as exc:  # with a real traceback, as torch records it
        import traceback

        wrapped = CheckpointException("failed", {0: (exc, traceback.extract_tb(exc.__traceback__))})
    assert "Traceback" in str(wrapped)
    err = dist_checks.explain_failure(wrapped, it_dir, index)
    assert err.path == shard and "truncated or corrupt" in str(err) and "Traceback" not in str(err)

    key = "decoder.layers.mlp.linear_fc2.weight"
    shape = CheckpointingException(f"Global shape mismatch for loaded (torch.Size([2, 64, 128])) and expected "
                                   f"((2, 96, 128)) tensor for key {key}")
    err = dist_checks.explain_failure(CheckpointException("failed", {1: (shape, None)}), it_dir, index)
    assert (err.path, err.tensor) == (shard, key)
    assert "stored shape (2, 64, 128) does not match (2, 96, 128)" in str(err)

    missing = RuntimeError("Missing key in checkpoint state_dict: decoder.final_layernorm.bias.")
    err = dist_checks.explain_failure(CheckpointException("failed", {0: (missing, None)}), it_dir, index)
    assert err.path.endswith(".metadata") and err.tensor == "decoder.final_layernorm.bias"

    gone = FileNotFoundError(2, "No such file or directory", shard)
    err = dist_checks.explain_failure(CheckpointException("failed", {0: (gone, None)}), it_dir, index)
    assert err.path == shard and "No such file" in str(err)


@pytest.mark.slow  # two command lines in subprocesses
def test_the_command_lines_exit_2_with_one_line(converted, tmp_path):
    """mcore-to-hf on a truncated shard with --no-verify-checksums writes nothing; --load of a
    folder whose model description disagrees with its shards names the tensor and "shape"."""
    ckpt = _copy(converted[0], tmp_path / "ckpt")
    shard = _shard(ckpt)
    truncate_half(shard)
    out = tmp_path / "hf"
    line = error_line(tool("convert_hf_checkpoint.py", ["mcore-to-hf", "--load", ckpt, "--out-dir", str(out),
                                                        "--no-progress", "--no-verify-checksums"], tmp_path, here=True))
    assert line.startswith(f"error: {shard}: truncated"), line
    assert not out.exists()

    ckpt = _copy(converted[0], tmp_path / "wider")
    _wider_model(_shard(ckpt))
    without_checksums(resolve_iteration_dir(ckpt))
    line = error_line(train(SMALL[2:] + ["--load", ckpt, "--train-iters", "1"], tmp_path, here=True))
    assert line.startswith(f"error: {_shard(ckpt)}: tensor 'decoder.") and "shape" in line, line
