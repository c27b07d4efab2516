"""Loading, validation and writing of trajectory samples (docs/data-format.md)."""

from __future__ import annotations

import json
import math
import os
import tracemalloc
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megatron_psrl.data import (
    SampleValidationError,
    UnknownFieldWarning,
    load_samples,
    samples_from_dicts,
    write_samples,
)
from megatron_psrl.data import validation as validation_module


def write_jsonl(path: Path, records) -> Path:
    """Records are dicts (dumped with NaN/Infinity allowed) or raw strings (written as is)."""
    with open(path, "w", encoding="utf-8") as handle:
        for rec in records:
            handle.write(rec if isinstance(rec, str) else json.dumps(rec))
            handle.write("\n")
    return path


GOOD = {"tokens": [1, 2, 3], "advantage": 0.5}


def good(i, **extra):
    return {"id": f"s{i}", **GOOD, **extra}


# ---------------------------------------------------------------------- loading
def test_defaults_and_broadcast(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [
        {"tokens": [5, 6, 7], "advantage": 2.0},
        "",  # blank lines are skipped
        {"tokens": [5, 6], "advantage": [0.0, -1.0], "loss_mask": [False, True], "weight": 3},
    ])
    batch = load_samples(path, vocab_size=8, require_advantage=True)
    assert batch.ids == [0, 1]  # default id: index of the sample in the file
    assert batch.offsets.tolist() == [0, 3, 5]
    assert batch.tokens.dtype == np.int32 and batch.tokens.tolist() == [5, 6, 7, 5, 6]
    assert batch.loss_mask.tolist() == [False, True, True, False, True]
    assert batch.advantages.tolist() == [2.0, 2.0, 2.0, 0.0, -1.0]
    assert batch.weights.tolist() == [1.0, 3.0]
    assert batch.old_logprobs is None and batch.ref_logprobs is None
    assert batch.source_rows.tolist() == [1, 3] and batch.row_label == "line"
    assert batch.describe_sample(1) == f"{path} line 3 (sample id 1)"


def test_optional_logprobs_and_forward_only(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [
        {"id": "a", "tokens": [1, 2, 3], "old_logprobs": [0.0, -0.5, -1.0]},
        {"id": "b", "tokens": [1, 2], "ref_logprobs": [0, -2]},
    ])
    batch = load_samples(path)
    assert batch.advantages is None  # forward-only file
    assert batch.has_old_logprobs.tolist() == [True, False]
    assert batch.old_logprobs.tolist() == [0.0, -0.5, -1.0, 0.0, 0.0]
    assert batch.has_ref_logprobs.tolist() == [False, True]
    assert batch.ref_logprobs.tolist() == [0.0, 0.0, 0.0, 0.0, -2.0]


def test_ignored_non_finite_entries_are_zeroed(tmp_path):
    """Per-token values where loss_mask is 0 are ignored by the contract: NaN/inf there are
    accepted and stored as 0, so no NaN can reach a kernel."""
    path = write_jsonl(tmp_path / "d.jsonl", [
        '{"id": 1, "tokens": [1, 2, 3], "loss_mask": [0, 1, 0], "advantage": [NaN, 1.0, '
        'Infinity], "old_logprobs": [NaN, -1.0, -Infinity]}',
    ])
    batch = load_samples(path)
    assert batch.advantages.tolist() == [0.0, 1.0, 0.0]
    assert batch.old_logprobs.tolist() == [0.0, -1.0, 0.0]


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_round_trip(tmp_path, suffix):
    records = [
        {"id": "x", "tokens": [1, 2, 3, 4], "loss_mask": [0, 1, 0, 1], "advantage": 0.25,
         "old_logprobs": [0.0, -0.1, -0.2, -0.3], "ref_logprobs": [0, -1.5, -2.5, -3.5],
         "weight": 2.0},
        {"id": "y", "tokens": [1, 2], "advantage": [0.0, 1e-3]},
        {"id": "z", "tokens": [9, 9, 9], "loss_mask": [0, 0, 0], "advantage": -7.0},
    ]
    original = samples_from_dicts(records, vocab_size=16)
    path = write_samples(original, tmp_path / f"out{suffix}")
    loaded = load_samples(path, vocab_size=16, require_advantage=True)
    assert loaded.ids == original.ids
    for name in ("offsets", "tokens", "loss_mask", "advantages", "old_logprobs",
                 "has_old_logprobs", "ref_logprobs", "has_ref_logprobs", "weights"):
        np.testing.assert_array_equal(getattr(loaded, name), getattr(original, name), name)
    assert [p.name for p in tmp_path.iterdir()] == [f"out{suffix}"]  # no temp file left


def test_round_trip_int_ids_and_parquet_mixed_ids(tmp_path):
    batch = samples_from_dicts([{"id": 7, "tokens": [1, 2]}, {"tokens": [3, 4]}])
    assert load_samples(write_samples(batch, tmp_path / "a.parquet")).ids == [7, 1]
    assert load_samples(write_samples(batch, tmp_path / "a.jsonl")).ids == [7, 1]
    mixed = samples_from_dicts([{"id": "a", "tokens": [1, 2]}, {"tokens": [3, 4]}])
    assert load_samples(write_samples(mixed, tmp_path / "m.parquet")).ids == ["a", "1"]
    colliding = samples_from_dicts([{"id": "1", "tokens": [1, 2]}, {"id": 1, "tokens": [3, 4]}])
    with pytest.raises(ValueError, match="collide"):
        write_samples(colliding, tmp_path / "c.parquet")
    assert not (tmp_path / "c.parquet").exists()


def test_write_is_atomic(tmp_path, monkeypatch):
    path = tmp_path / "keep.jsonl"
    path.write_text("previous content\n")
    batch = samples_from_dicts([good(i) for i in range(3)])
    calls = {"n": 0}
    real_dumps = json.dumps

    def failing_dumps(obj, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("disk full")
        return real_dumps(obj, **kwargs)

    monkeypatch.setattr("megatron_psrl.data.loader.json.dumps", failing_dumps)
    with pytest.raises(RuntimeError, match="disk full"):
        write_samples(batch, path)
    assert path.read_text() == "previous content\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.jsonl"]


def test_unknown_fields_warn_once_and_are_ignored(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [good(0, reward=1.0), good(1, prompt="hi")])
    with pytest.warns(UnknownFieldWarning, match=r"\['prompt', 'reward'\] \(first at line 1\)"):
        batch = load_samples(path)
    assert batch.num_samples == 2


def test_chunked_accumulation_equals_single_chunk(tmp_path, monkeypatch):
    records = [{"id": i, "tokens": list(range(i % 7 + 2)), "advantage": float(i),
                "old_logprobs": [-0.5] * (i % 7 + 2) if i % 3 == 0 else None}
               for i in range(50)]
    reference = samples_from_dicts(records)
    monkeypatch.setattr(validation_module, "FLUSH_TOKENS", 5)
    chunked = samples_from_dicts(records)
    for name in ("offsets", "tokens", "loss_mask", "advantages", "old_logprobs"):
        np.testing.assert_array_equal(getattr(chunked, name), getattr(reference, name))


def test_large_jsonl_streams_with_bounded_memory(tmp_path):
    """A 400k-token file: peak memory stays below twice the result arrays (9 bytes per token),
    far below what keeping the parsed JSON lists alive takes (~36 bytes per token, 14.5 MB)."""
    rng = np.random.default_rng(0)
    path = tmp_path / "big.jsonl"
    with open(path, "w") as handle:
        for i in range(100):
            handle.write(json.dumps({"id": i, "tokens": rng.integers(300, 50000, 4000).tolist(),
                                     "advantage": 1.0}) + "\n")
    tracemalloc.start()
    try:
        batch = load_samples(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert batch.num_tokens == 400_000
    result_bytes = batch.tokens.nbytes + batch.loss_mask.nbytes + batch.advantages.nbytes
    assert peak < 2 * result_bytes, (peak, result_bytes)


def test_parquet_streams_in_record_batches(tmp_path, monkeypatch):
    records = [good(i, tokens=[i % 5, 1, 2]) for i in range(700)]
    path = write_samples(samples_from_dicts(records), tmp_path / "p.parquet")
    monkeypatch.setattr("megatron_psrl.data.loader.PARQUET_BATCH_ROWS", 64)
    batch = load_samples(path, progress=True)
    assert batch.num_samples == 700 and batch.ids[-1] == "s699"
    assert batch.source_rows[-1] == 699 and batch.row_label == "row"


# ---------------------------------------------------------------------- bad input: JSONL
def jsonl_error(tmp_path, records, **kwargs) -> str:
    path = write_jsonl(tmp_path / "data.jsonl", records)
    with pytest.raises(SampleValidationError) as info:
        load_samples(path, **kwargs)
    assert isinstance(info.value, ValueError)
    return str(info.value).replace(str(tmp_path) + os.sep, "")


BAD_SAMPLES = [
    # (sample at line 2, expected message after "data.jsonl line 2 (sample id 'bad'): ")
    ({"tokens": "abc"}, "field 'tokens': must be a list of integers, got str 'abc'"),
    ({"tokens": [1, 1.5]}, "field 'tokens': element 1 is float 1.5; token ids must be integers"),
    ({"tokens": [1, 1.0]}, "field 'tokens': element 1 is float 1.0; token ids must be integers"),
    ({"tokens": [1, True]}, "field 'tokens': element 1 is bool True; token ids must be integers"),
    ({"tokens": [1, None]}, "field 'tokens': element 1 is NoneType None"),
    ({"tokens": [1, [2]]}, "field 'tokens': element 1 is list [2]"),
    ({"tokens": [1, 2, 3], "loss_mask": [0, 1]}, "field 'loss_mask': length 2 != len(tokens) 3"),
    ({"tokens": [1, 2], "loss_mask": [0, 2]}, "field 'loss_mask': element 1 is 2; expected 0/1"),
    ({"tokens": [1, 2], "loss_mask": [0, 1.0]}, "field 'loss_mask': element 1 is float 1.0"),
    ({"tokens": [1, 2], "loss_mask": "01"}, "field 'loss_mask': must be a list of 0/1"),
    ({"tokens": [1, 2], "loss_mask": [1, 1]}, "field 'loss_mask': loss on token 0"),
    ({"tokens": [1, 2], "loss_mask": [True, False]}, "field 'loss_mask': loss on token 0"),
    ({"tokens": [1, 16]}, "field 'tokens': token id 16 at position 1 is outside [0, 16)"),
    ({"tokens": [-1, 2]}, "field 'tokens': token id -1 at position 0 is outside [0, 16)"),
    ({"tokens": [1, 2**70]}, "field 'tokens': token id 1180591620717411303424 at position 1 is "
                             "out of range"),
    ({"tokens": [7]}, "field 'tokens': a sample needs at least 2 tokens, got 1"),
    ({"tokens": []}, "field 'tokens': a sample needs at least 2 tokens, got 0"),
    ({"loss_mask": [0, 1]}, "field 'tokens': missing required field"),
    ({"tokens": None}, "field 'tokens': missing required field"),
    ({"tokens": [1, 2], "advantage": "high"}, "field 'advantage': must be a number, got str"),
    ({"tokens": [1, 2], "advantage": {"a": 1}}, "field 'advantage': must be a number, got dict"),
    ({"tokens": [1, 2], "advantage": True}, "field 'advantage': must be a number, got bool True"),
    ({"tokens": [1, 2], "advantage": [0.1, 0.2, 0.3]},
     "field 'advantage': length 3 != len(tokens) 2"),
    ({"tokens": [1, 2], "advantage": 1e39}, "field 'advantage': 1e+39 is not finite (in float32)"),
    ({"tokens": [1, 2], "advantage": [0, "x"]}, "field 'advantage': element 1 is str 'x'"),
    ({"tokens": [1, 2], "old_logprobs": [0.0]}, "field 'old_logprobs': length 1 != len(tokens) 2"),
    ({"tokens": [1, 2], "ref_logprobs": [0.0, None]},
     "field 'ref_logprobs': element 1 is NoneType None; expected a number"),
    ({"tokens": [1, 2], "weight": "1"}, "field 'weight': must be a number, got str '1'"),
    ({"tokens": [1, 2], "weight": [1.0]}, "field 'weight': must be a number, got list [1.0]"),
    ({"tokens": [1, 2], "weight": -0.5}, "field 'weight': must be >= 0, got -0.5"),
]


@pytest.mark.parametrize("sample, message", BAD_SAMPLES)
def test_bad_sample_messages(tmp_path, sample, message):
    if "advantage" not in sample:
        sample = {**sample, "advantage": 0.5}
    text = jsonl_error(tmp_path, [good(0), {"id": "bad", **sample}], vocab_size=16)
    assert text.startswith("data.jsonl line 2 (sample id 'bad'): " + message), text


def test_the_documented_example_message(tmp_path):
    records = [good(i) for i in range(6)]
    records.append({"id": "abc", "tokens": list(range(13)), "loss_mask": [0] * 12,
                    "advantage": 1.0})
    assert jsonl_error(tmp_path, records) == (
        "data.jsonl line 7 (sample id 'abc'): field 'loss_mask': length 12 != len(tokens) 13"
    )


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_advantage(tmp_path, literal):
    line = '{"id": "n", "tokens": [1, 2], "advantage": %s}' % literal
    text = jsonl_error(tmp_path, [line])
    assert text.startswith("data.jsonl line 1 (sample id 'n'): field 'advantage': ")
    assert "not finite" in text


@pytest.mark.parametrize("field", ["advantage", "old_logprobs", "ref_logprobs"])
def test_non_finite_per_token_value_where_trained(tmp_path, field):
    line = '{"id": 4, "tokens": [1, 2, 3], "advantage": 1.0, "%s": [0, -1, NaN]}' % field
    assert jsonl_error(tmp_path, [line]) == (
        f"data.jsonl line 1 (sample id 4): field '{field}': value nan at position 2 is not "
        "finite (in float32) where loss_mask is 1"
    )


def test_bad_id(tmp_path):
    assert jsonl_error(tmp_path, [{"id": 1.5, "tokens": [1, 2]}]) == (
        "data.jsonl line 1: field 'id': must be a string or an integer, got float 1.5"
    )
    assert "got bool True" in jsonl_error(tmp_path, [{"id": True, "tokens": [1, 2]}])


def test_duplicate_id(tmp_path):
    text = jsonl_error(tmp_path, [good(0), good(1), good(0)])
    assert text == "data.jsonl line 3 (sample id 's0'): field 'id': duplicate id (first used at " \
                   "line 1)"
    # A default id (the sample index) can collide with an explicit one too.
    text = jsonl_error(tmp_path, [{"id": 1, **GOOD}, GOOD])
    assert text.startswith("data.jsonl line 2 (sample id 1): field 'id': duplicate id")


def test_advantage_required_or_consistent(tmp_path):
    text = jsonl_error(tmp_path, [{"id": "a", "tokens": [1, 2]}], require_advantage=True)
    assert text == "data.jsonl line 1 (sample id 'a'): field 'advantage': missing (required " \
                   "for training)"
    text = jsonl_error(tmp_path, [good(0), {"id": "b", "tokens": [1, 2]}])
    assert text.startswith("data.jsonl line 2 (sample id 'b'): field 'advantage': missing, but "
                           "the first sample (line 1) carries one")


def test_kl_required(tmp_path):
    text = jsonl_error(tmp_path, [good(0, ref_logprobs=[0, -1, -1]), good(1)], kl_required=True)
    assert text == "data.jsonl line 2 (sample id 's1'): field 'ref_logprobs': missing " \
                   "(required by the KL penalty)"


def test_malformed_and_non_object_lines(tmp_path):
    text = jsonl_error(tmp_path, [good(0), good(1), '{"id": "x", "tokens": [1, 2'])
    assert text == "data.jsonl line 3: malformed JSON: Expecting ',' delimiter (column 29)"
    text = jsonl_error(tmp_path, [good(0), "[1, 2, 3]"])
    assert text == "data.jsonl line 2: expected a JSON object (mapping), got list [1, 2, 3]"
    (tmp_path / "bin.jsonl").write_bytes(b'{"tokens": [1, 2]}\n\xff\xfe\n')
    with pytest.raises(SampleValidationError, match=r"bin.jsonl line 2: malformed JSON: not UTF-8"):
        load_samples(tmp_path / "bin.jsonl")


def test_empty_and_unreadable_files(tmp_path):
    assert jsonl_error(tmp_path, []) == "data.jsonl: no samples (empty file)"
    assert jsonl_error(tmp_path, ["", "   "]) == "data.jsonl: no samples (empty file)"
    with pytest.raises(SampleValidationError, match=r"missing.jsonl: cannot read file: "):
        load_samples(tmp_path / "missing.jsonl")
    (tmp_path / "dir.jsonl").mkdir()
    with pytest.raises(SampleValidationError, match=r"dir.jsonl: cannot read file"):
        load_samples(tmp_path / "dir.jsonl")
    with pytest.raises(SampleValidationError, match=r"unknown file type '.csv'"):
        load_samples(tmp_path / "data.csv")


def test_nothing_half_processed(tmp_path):
    """The error comes before any batch exists: a bad last line rejects the whole file."""
    records = [good(i) for i in range(20)] + [{"id": "last", "tokens": [1]}]
    text = jsonl_error(tmp_path, records)
    assert text.startswith("data.jsonl line 21 (sample id 'last')")


# ---------------------------------------------------------------------- bad input: Parquet
def parquet_error(tmp_path, table: pa.Table, **kwargs) -> str:
    path = tmp_path / "data.parquet"
    pq.write_table(table, path)
    with pytest.raises(SampleValidationError) as info:
        load_samples(path, **kwargs)
    return str(info.value).replace(str(tmp_path) + os.sep, "")


def test_parquet_bad_rows(tmp_path):
    table = pa.table({"id": ["a", "b", "c"],
                      "tokens": [[1, 2], [1, 2, 3], [4, 5]],
                      "loss_mask": [[0, 1], [0, 1, 1], [0, 1, 1]]})
    assert parquet_error(tmp_path, table) == (
        "data.parquet row 2 (sample id 'c'): field 'loss_mask': length 3 != len(tokens) 2"
    )
    table = pa.table({"tokens": [[1.0, 2.0]]})  # a column of the wrong type: before any row (test_parquet_types.py)
    assert parquet_error(tmp_path, table) == (
        "data.parquet: field 'tokens': column type list<element: double> is not supported; expected a list of "
        "integer token ids (e.g. list<int32>)"
    )
    table = pa.table({"id": [3, 4], "tokens": [[1, 2], [1, None]]})
    assert parquet_error(tmp_path, table) == (
        "data.parquet row 1 (sample id 4): field 'tokens': element 1 is NoneType None; token "
        "ids must be integers"
    )
    table = pa.table({"id": [3, 4], "tokens": [[1, 2], None]})
    assert parquet_error(tmp_path, table) == (
        "data.parquet row 1 (sample id 4): field 'tokens': missing required field"
    )
    table = pa.table({"id": ["x", "x"], "tokens": [[1, 2], [3, 4]]})
    assert parquet_error(tmp_path, table) == (
        "data.parquet row 1 (sample id 'x'): field 'id': duplicate id (first used at row 0)"
    )
    table = pa.table({"tokens": [[1, 2], [3, 99]]})
    assert parquet_error(tmp_path, table, vocab_size=50) == (
        "data.parquet row 1 (sample id 1): field 'tokens': token id 99 at position 1 is "
        "outside [0, 50) (vocab_size 50)"
    )
    table = pa.table({"tokens": [[1, 2]], "advantage": [math.nan]})
    assert parquet_error(tmp_path, table).startswith(
        "data.parquet row 0 (sample id 0): field 'advantage': nan is not finite"
    )
    table = pa.table({"tokens": [[1, 2]], "loss_mask": [["0", "1"]]})
    assert parquet_error(tmp_path, table) == (
        "data.parquet: field 'loss_mask': column type list<element: string> is not supported; expected a list of "
        "0/1 integers or booleans (e.g. list<bool>)"
    )
    table = pa.table({"tokens": [[1, 2]], "loss_mask": [[0, 2]]})  # the right type, a wrong value: its row
    assert parquet_error(tmp_path, table) == (
        "data.parquet row 0 (sample id 0): field 'loss_mask': element 1 is 2; expected 0/1 or a boolean"
    )


def test_parquet_file_level_errors(tmp_path):
    assert parquet_error(tmp_path, pa.table({"input_ids": [[1, 2]]})) == (
        "data.parquet row 0: field 'tokens': missing required field (no 'tokens' column)"
    )
    empty = pa.table({"tokens": pa.array([], type=pa.list_(pa.int32()))})
    assert parquet_error(tmp_path, empty) == "data.parquet: no samples (empty file)"
    (tmp_path / "junk.parquet").write_bytes(b"not a parquet file at all")
    with pytest.raises(SampleValidationError, match=r"junk.parquet: cannot read Parquet file"):
        load_samples(tmp_path / "junk.parquet")


def test_parquet_unknown_columns_warn(tmp_path):
    path = tmp_path / "u.parquet"
    pq.write_table(pa.table({"tokens": [[1, 2]], "reward": [1.0]}), path)
    with pytest.warns(UnknownFieldWarning, match=r"\['reward'\] \(first at row 0\)"):
        assert load_samples(path).num_samples == 1


# ---------------------------------------------------------------------- in memory
def test_in_memory_messages_and_numpy_values():
    with pytest.raises(SampleValidationError) as info:
        samples_from_dicts([good(0), good(1), {"id": "z", "tokens": np.array([1.0, 2.0])}],
                           source="<rollouts>")
    assert str(info.value) == ("<rollouts> row 2 (sample id 'z'): field 'tokens': must be a list "
                               "of integers, got an array of dtype float64")
    batch = samples_from_dicts([{"id": np.int64(3), "tokens": np.array([1, 2], np.uint16),
                                 "loss_mask": np.array([0, 1], np.int8),
                                 "advantage": np.float32(0.5)}])
    assert batch.ids == [3] and batch.loss_mask.tolist() == [False, True]
    with pytest.raises(SampleValidationError, match=r"<memory>: no samples"):
        samples_from_dicts([])
    with pytest.raises(SampleValidationError, match="shape"):
        samples_from_dicts([{"tokens": np.zeros((2, 2), np.int32)}])
