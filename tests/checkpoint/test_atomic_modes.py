"""Outputs written through temporaries get the mode a plain ``open`` / ``os.mkdir`` would give
them under the umask: a checkpoint one user saves (tracker, checksums, converted folders) and the
traces written next to it can be read by a teammate whenever its data files can."""

import os
import stat

import pytest

from megatron_psrl.checkpoint.atomic import atomic_directory, atomic_write_text
from megatron_psrl.checkpoint.checksums import MANIFEST, write_manifest
from megatron_psrl.data import samples_from_dicts, write_samples

UMASKS = {0o022: (0o644, 0o755), 0o077: (0o600, 0o700)}
"""umask -> (file mode, folder mode) that ``open`` / ``os.mkdir`` give under it."""


@pytest.fixture(params=sorted(UMASKS), ids=lambda u: f"umask{u:03o}")
def umask(request):
    # os.umask is process-global: set for this test only, restored whatever happens.
    previous = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(previous)


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_atomic_text_has_the_umask_mode(tmp_path, umask):
    atomic_write_text(str(tmp_path / "latest_checkpointed_iteration.txt"), "7")
    plain = tmp_path / "plain.bin"
    plain.write_bytes(b"")  # a data file written the ordinary way, for comparison
    assert _mode(tmp_path / "latest_checkpointed_iteration.txt") == UMASKS[umask][0] == _mode(plain)


def test_checksums_have_the_umask_mode(tmp_path, umask):
    (tmp_path / "model.pt").write_bytes(b"weights")
    write_manifest(str(tmp_path))
    assert _mode(tmp_path / MANIFEST) == UMASKS[umask][0] == _mode(tmp_path / "model.pt")


def test_atomic_directory_has_the_umask_mode(tmp_path, umask):
    with atomic_directory(str(tmp_path / "out")) as tmp:
        with open(os.path.join(tmp, "config.json"), "w") as f:
            f.write("{}")
    assert _mode(tmp_path / "out") == UMASKS[umask][1]
    assert _mode(tmp_path / "out" / "config.json") == UMASKS[umask][0]


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_written_samples_have_the_umask_mode(tmp_path, umask, suffix):
    path = write_samples(samples_from_dicts([{"tokens": [1, 2, 3]}]), tmp_path / f"trace{suffix}")
    assert _mode(path) == UMASKS[umask][0]
