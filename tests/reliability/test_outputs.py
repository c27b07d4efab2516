"""Outputs are checked before any compute; one writer per --save folder; a failed or killed save
leaves nothing behind and a full disk does not stay full."""

import errno
import json
import os
import shutil
import socket
import subprocess
import sys
import uuid

import pytest
import torch
from helpers.faults import SMALL, error_line, leftovers, train

from megatron_psrl.checkpoint import legacy_format
from megatron_psrl.checkpoint.layout import TRACKER, read_checkpoint_info
from megatron_psrl.checkpoint.lock import LOCK_NAME, SaveDirLock
from megatron_psrl.checkpoint.saving import save_training_checkpoint
from megatron_psrl.distributed.setup import initialize_parallel
from megatron_psrl.errors import CheckpointWriteError, ConfigurationError
from megatron_psrl.model import tiny_config
from megatron_psrl.model.architecture import ModelArchitecture
from megatron_psrl.model.builder import build_model
from megatron_psrl.training.preflight import warn_if_disk_short


def _not_a_dir(tmp_path):
    """A path under a regular file: unwritable even for root."""
    blocker = tmp_path / "blocker"
    blocker.write_text("a file, not a folder")
    return blocker / "out"


@pytest.mark.parametrize("flag", ["--save", "--log-json"])
def test_unwritable_output_fails_before_any_compute(flag, tmp_path):
    target = _not_a_dir(tmp_path)
    proc = train(SMALL + ["--train-iters", "50", flag, str(target)], tmp_path, timeout=120, here=True)
    line = error_line(proc)
    assert str(target) in line and flag in line
    assert "iteration" not in proc.stdout  # nothing trained


def test_read_only_folder_fails_before_any_compute(tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root writes into read-only folders; the not-a-folder case covers root")
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        proc = train(SMALL + ["--train-iters", "50", "--save", str(ro / "ckpt")], tmp_path, timeout=120, here=True)
    finally:
        ro.chmod(0o700)
    assert str(ro / "ckpt") in error_line(proc) and "iteration" not in proc.stdout


def test_compute_logprobs_checks_out_before_loading(tmp_path):
    from helpers.faults import tool

    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"tokens": [1, 2, 3]}) + "\n")
    target = _not_a_dir(tmp_path) / "lp.jsonl"
    proc = tool("compute_logprobs.py", ["--hf-dir", str(tmp_path / "no-such-model"), "--data", str(data),
                                        "--out", str(target)], tmp_path, timeout=120, here=True)
    assert str(target.parent) in error_line(proc)  # the output is checked first


@pytest.mark.slow  # a writer in another process (launch pool): the lock holder must be another pid
def test_second_writer_is_refused_naming_the_holder(tmp_path):
    save = tmp_path / "ckpt"
    holder = SaveDirLock(str(save))
    save.mkdir()
    holder.acquire()  # this (live) test process holds the folder
    try:
        proc = train(SMALL + ["--train-iters", "1", "--save", str(save)], tmp_path, timeout=120)
    finally:
        holder.release()
    line = error_line(proc)
    assert f"pid {os.getpid()}" in line and socket.gethostname() in line and LOCK_NAME in line
    assert "iteration" not in proc.stdout
    assert not (save / LOCK_NAME).exists()  # released by its holder


@pytest.mark.slow  # a writer in another process (launch pool): this pid's temporary stays
def test_stale_lock_and_dead_writers_temporaries_are_cleaned(tmp_path, dead_pid):
    save = tmp_path / "ckpt"
    save.mkdir()
    (save / LOCK_NAME).write_text(json.dumps({"pid": dead_pid, "host": socket.gethostname(), "run_id": None,
                                              "started": 0}))
    stale = save / f"iter_0000007.tmp-{dead_pid}"
    (stale / "mp_rank_00").mkdir(parents=True)
    (stale / "mp_rank_00" / "model_optim_rng.pt").write_bytes(b"\0" * (1 << 20))  # a killed save's partial file
    (save / f".tmp-{dead_pid}-abc").write_text("2")  # a killed tracker update
    live = save / f".tmp-{os.getpid()}-lp.jsonl"  # another live tool's temporary: left alone
    live.write_text("x")
    proc = train(SMALL + ["--train-iters", "1", "--save", str(save)], tmp_path, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "took over the lock" in proc.stdout
    assert f"removed iter_0000007.tmp-{dead_pid} (an unfinished save" in proc.stdout
    assert f"removed .tmp-{dead_pid}-abc" in proc.stdout
    assert leftovers(save) == [str(live)] and not (save / LOCK_NAME).exists()
    assert read_checkpoint_info(str(save))[1].iteration == 1


def test_an_interrupted_resave_is_restored_not_deleted(tmp_path, dead_pid):
    """A re-save moved iter_N aside and died before renaming the new one in: the tracker points
    at a missing iter_N; the next start-up puts the old copy back and resumes from it."""
    save = tmp_path / "ckpt"
    proc = train(SMALL + ["--train-iters", "1", "--save", str(save)], tmp_path, timeout=180, here=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    os.rename(save / "iter_0000001", save / f"iter_0000001.old-{dead_pid}")
    proc = train(SMALL + ["--train-iters", "2", "--save", str(save), "--load", str(save)], tmp_path, timeout=180, here=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"restored iter_0000001 from iter_0000001.old-{dead_pid}" in proc.stdout
    assert "resuming from" in proc.stdout and "iteration      2/" in proc.stdout
    assert read_checkpoint_info(str(save))[1].iteration == 2 and leftovers(save) == []


@pytest.mark.slow  # a writer process killed mid-save
def test_a_killed_save_is_removed_by_the_next_run(tmp_path):
    """SIGKILL a real writer in the middle of its temporary folder; the next save cleans it."""
    save = tmp_path / "ckpt"
    save.mkdir()
    writer = subprocess.Popen(
        [sys.executable, "-c", "import os, sys, time\n"
         f"d = os.path.join({str(save)!r}, 'iter_0000003.tmp-%d' % os.getpid())\n"
         "os.makedirs(d)\n"
         "open(os.path.join(d, 'partial.pt'), 'wb').write(b'x' * 4096)\n"
         "print('ready', flush=True)\n"
         "time.sleep(600)\n"], stdout=subprocess.PIPE, text=True)
    assert writer.stdout.readline().strip() == "ready"
    writer.kill()
    writer.wait()
    assert len(leftovers(save)) == 1 and any(save.glob("iter_0000003.tmp-*/partial.pt"))
    proc = train(SMALL + ["--train-iters", "1", "--save", str(save)], tmp_path, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert leftovers(save) == []


def _mount_tmpfs(path, size):
    path.mkdir()
    try:
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True,
                       capture_output=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        path.rmdir()
        return False
    return True


@pytest.mark.parametrize("fmt,name", [("legacy", "model_optim_rng.pt"), ("torch_dist", "__0_0.distcp")])
def test_disk_full_during_save_names_the_file_and_frees_the_disk(tmp_path, fmt, name):
    """A real full disk (a 600 KiB tmpfs, half a checkpoint; skipped where mounting is not allowed, the simulated
    ENOSPC test below covers the logic): the run ends with one line naming the file, the
    partial save is removed, and the disk is as free as before."""
    disk = tmp_path / "disk"
    if not _mount_tmpfs(disk, "600k"):
        pytest.skip("cannot mount a tmpfs here")
    try:
        free_before = shutil.disk_usage(disk).free
        proc = train(SMALL + ["--train-iters", "1", "--save", str(disk / "ckpt"), "--ckpt-format", fmt], tmp_path,
                     timeout=180, here=True)
        line = error_line(proc)
        assert name in line and "No space left on device" in line, line
        assert "the save failed and was removed" in line
        assert leftovers(disk) == [] and shutil.disk_usage(disk).free == free_before
        assert "iteration      1/" in proc.stdout  # it trained, then reported the save
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)


def test_simulated_disk_full_is_reported_and_removed(tmp_path, monkeypatch):
    initialize_parallel(1, 1, seed=0, device="cpu")
    layout = initialize_parallel(1, 1, seed=0, device="cpu")
    arch = ModelArchitecture.from_hf_config(tiny_config("debug-llama"))
    model = build_model(arch)
    real_save = torch.save

    def full_disk(obj, f, *args, **kwargs):
        real_save(obj, f, *args, **kwargs)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(legacy_format.torch, "save", full_disk)
    with pytest.raises(CheckpointWriteError, match=r"model_optim_rng\.pt.*No space left on device"):
        save_training_checkpoint(str(tmp_path / "ckpt"), 4, model, None, arch, layout, ckpt_format="legacy")
    assert leftovers(tmp_path) == [] and not (tmp_path / "ckpt" / TRACKER).exists()


def test_simulated_disk_full_in_torch_dist_names_the_rank_file(tmp_path, monkeypatch):
    """The same through megatron's torch_dist writer (compat item 7 writes in this process):
    the error names this rank's ``.distcp`` file, and nothing is left."""
    import megatron.core.dist_checkpointing.strategies.filesystem_async as writer

    layout = initialize_parallel(1, 1, seed=0, device="cpu")
    arch = ModelArchitecture.from_hf_config(tiny_config("debug-llama"))
    model = build_model(arch)
    real_write = writer._write_item

    def full_disk(transforms, stream, data, write_item, storage_key, serialization_format=None):
        real_write(transforms, stream, data, write_item, storage_key, serialization_format=serialization_format)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(writer, "_write_item", full_disk)
    with pytest.raises(CheckpointWriteError, match=r"__0_0\.distcp: No space left on device"):
        save_training_checkpoint(str(tmp_path / "ckpt"), 4, model, None, arch, layout, ckpt_format="torch_dist")
    assert leftovers(tmp_path) == [] and not (tmp_path / "ckpt" / TRACKER).exists()


def test_disk_space_warning_names_the_need(tmp_path):
    assert warn_if_disk_short(str(tmp_path), 1) is None
    warning = warn_if_disk_short(str(tmp_path), 1 << 60)
    assert warning.startswith("warning:") and str(tmp_path) in warning and "GiB" in warning


def test_lock_taken_over_within_the_same_torchrun_job(tmp_path, monkeypatch):
    """A restarted worker group (same TORCHELASTIC_RUN_ID, maybe another host) takes its lock back."""
    run_id = uuid.uuid4().hex
    save = tmp_path / "ckpt"
    save.mkdir()
    (save / LOCK_NAME).write_text(json.dumps({"pid": 1, "host": "another-node", "run_id": run_id, "started": 0}))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", run_id)
    lock = SaveDirLock(str(save)).acquire()
    assert lock.took_over["host"] == "another-node"
    lock.release()
    (save / LOCK_NAME).write_text(json.dumps({"pid": 1, "host": "another-node", "run_id": "other", "started": 0}))
    with pytest.raises(ConfigurationError, match="another-node"):
        SaveDirLock(str(save)).acquire()
