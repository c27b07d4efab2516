"""Checkpoints that cannot silently corrupt: every save lists every file's SHA-256, and every
reader (``--load``, the converter, ``compute_logprobs``, ``PolicyActor.load``) verifies them
before it reads a tensor; a damaged file is one line naming it, exit status 2, and no output."""

import hashlib
import logging
import os

import pytest
from helpers.faults import SMALL, empty_file, error_line, flip_bytes, train, truncate_half

from megatron_psrl import ActorConfig, OptimizerSettings, PolicyActor
from megatron_psrl.checkpoint.checksums import MANIFEST, VERIFY_ENV, verify_folder
from megatron_psrl.checkpoint.layout import read_checkpoint_info, resolve_iteration_dir
from megatron_psrl.errors import CheckpointError


@pytest.fixture(scope="module", params=["torch_dist", "legacy"])
def saved(request, tmp_path_factory):
    """A one-step debug-llama checkpoint with Adam state, saved by PolicyActor in each format."""
    root = tmp_path_factory.mktemp(f"ckpt-{request.param}")
    actor = PolicyActor("debug-llama", ActorConfig(device="cpu", ckpt_format=request.param,
                                                   optimizer=OptimizerSettings(optimizer="adam", lr=1e-3)))
    tokens = list(range(1, 40))
    actor.train_step([{"tokens": tokens, "advantage": 1.0}, {"tokens": tokens[:20] + [7] * 9, "advantage": -1.0}])
    actor.save(str(root / "ckpt"))
    return request.param, str(root / "ckpt")


def _copy(src: str, dst) -> str:
    import shutil

    shutil.copytree(src, dst)
    return str(dst)


def _shard(it_dir: str, fmt: str) -> str:
    rel = "__0_0.distcp" if fmt == "torch_dist" else os.path.join("mp_rank_00", "model_optim_rng.pt")
    return os.path.join(it_dir, rel)


def test_every_file_is_listed_with_its_sha256(saved):
    fmt, ckpt = saved
    it_dir = resolve_iteration_dir(ckpt)
    listed = {}
    with open(os.path.join(it_dir, MANIFEST)) as f:
        for line in f:
            digest, rel = line.rstrip("\n").split("  ", 1)
            listed[rel] = digest
    on_disk = sorted(os.path.relpath(os.path.join(d, n), it_dir) for d, _, fs in os.walk(it_dir) for n in fs)
    assert sorted(listed) == [p for p in on_disk if p != MANIFEST]
    assert "psrl_model.json" in listed and os.path.relpath(_shard(it_dir, fmt), it_dir) in listed
    for rel, digest in listed.items():  # sha256sum's format: checkable by hand
        assert hashlib.sha256(open(os.path.join(it_dir, rel), "rb").read()).hexdigest() == digest
    assert verify_folder(it_dir)


DAMAGE = {"flipped": (flip_bytes, "checksum mismatch"), "truncated": (truncate_half, "checksum mismatch"),
          "empty": (empty_file, "checksum mismatch"), "deleted": (os.remove, "missing")}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_shard_is_named_by_every_reader_in_process(saved, damage, tmp_path):
    fmt, ckpt = saved
    ckpt = _copy(ckpt, tmp_path / "ckpt")
    shard = _shard(resolve_iteration_dir(ckpt), fmt)
    hurt, words = DAMAGE[damage]
    hurt(shard)
    with pytest.raises(CheckpointError, match=words) as err:
        read_checkpoint_info(ckpt)
    assert err.value.path == shard
    with pytest.raises(CheckpointError, match=words):
        PolicyActor(ckpt, ActorConfig(device="cpu"))


@pytest.mark.slow  # the command lines in subprocesses
def test_a_flipped_shard_stops_load_and_the_converter_in_one_line(saved, tmp_path):
    """The issue's worst row: 64 flipped bytes used to convert to an HF model with weights off
    by 1,387, exit 0. Now: exit 2, one line naming the shard, no HF folder written."""
    fmt, ckpt = saved
    ckpt = _copy(ckpt, tmp_path / "ckpt")
    shard = _shard(resolve_iteration_dir(ckpt), fmt)
    flip_bytes(shard)
    from helpers.faults import tool

    out = tmp_path / "hf"
    line = error_line(tool("convert_hf_checkpoint.py", ["mcore-to-hf", "--load", ckpt, "--out-dir", str(out),
                                                        "--no-progress"], tmp_path, here=True))
    assert shard in line and "checksum mismatch (corrupt or modified after save)" in line, line
    assert not out.exists()
    line = error_line(train(SMALL + ["--load", ckpt, "--train-iters", "2"], tmp_path, here=True))
    assert shard in line and "checksum mismatch" in line, line


def test_an_edited_model_description_is_refused(saved, tmp_path):
    """psrl_model.json saying hidden 96 while the shards hold 64: named before any shape error."""
    fmt, ckpt = saved
    ckpt = _copy(ckpt, tmp_path / "ckpt")
    path = os.path.join(resolve_iteration_dir(ckpt), "psrl_model.json")
    text = open(path).read()
    assert '"hidden_size": 64' in text
    open(path, "w").write(text.replace('"hidden_size": 64', '"hidden_size": 96'))
    with pytest.raises(CheckpointError, match="checksum mismatch") as err:
        read_checkpoint_info(ckpt)
    assert err.value.path == path


def test_a_checkpoint_without_checksums_loads_with_one_note(saved, tmp_path, caplog):
    fmt, ckpt = saved
    ckpt = _copy(ckpt, tmp_path / "ckpt")
    it_dir = resolve_iteration_dir(ckpt)
    os.remove(os.path.join(it_dir, MANIFEST))
    with caplog.at_level(logging.WARNING, logger="megatron_psrl"):
        assert read_checkpoint_info(ckpt)[1].iteration == 1
        read_checkpoint_info(ckpt)
    notes = [r.getMessage() for r in caplog.records if "cannot be verified" in r.getMessage()]
    assert len(notes) == 1 and it_dir in notes[0]


def test_verification_can_be_skipped(saved, tmp_path, monkeypatch):
    """For checkpoints too large to read twice (``--no-verify-checksums``): nothing is read."""
    fmt, ckpt = saved
    ckpt = _copy(ckpt, tmp_path / "ckpt")
    flip_bytes(_shard(resolve_iteration_dir(ckpt), fmt))
    monkeypatch.setenv(VERIFY_ENV, "0")
    assert read_checkpoint_info(ckpt)[1].iteration == 1
