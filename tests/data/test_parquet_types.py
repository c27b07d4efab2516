"""Parquet column types: what the reader accepts (every Arrow list kind, dictionary-encoded
columns, integers and floats of any width) reads exactly; every other type is one
:class:`SampleValidationError` naming the file, the column and what the field needs, before
any row is read (docs/data-format.md, "Parquet column types")."""

from __future__ import annotations

import datetime
import decimal
import os
import tempfile
import warnings
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, event, given, reject, settings
from hypothesis import strategies as st

from megatron_psrl.data import SampleValidationError, load_samples
from megatron_psrl.data.validation import KNOWN_FIELDS


def load_error(tmp_path: Path, table: pa.Table) -> str:
    path = tmp_path / "data.parquet"
    pq.write_table(table, path)
    with pytest.raises(SampleValidationError) as info:
        load_samples(path)
    return str(info.value).replace(str(tmp_path) + os.sep, "")


# ---------------------------------------------------------------------- refused column types
def test_nested_token_lists_are_one_error_naming_file_and_column(tmp_path):
    """The reported case: list<list<int>> tokens used to end in an AttributeError traceback."""
    table = pa.table({"tokens": [[[1, 2], [3]], [[4, 5]]]})
    assert load_error(tmp_path, table) == (
        "data.parquet: field 'tokens': column type list<element: list<element: int64>> is not supported; "
        "expected a list of integer token ids (e.g. list<int32>)"
    )


GOOD_TOKENS = pa.array([[1, 2, 3], [4, 5]])


@pytest.mark.parametrize("field, column, expected", [
    ("tokens", pa.array([[1.0, 2.0], [3.0, 4.0]]), "list<element: double>"),
    ("tokens", pa.array([1, 2]), "int64"),
    ("loss_mask", pa.array([["0", "1", "1"], ["0", "1"]]), "list<element: string>"),
    ("loss_mask", pa.array([[[0], [1]], [[0]]]), "list<element: list<element: int64>>"),
    ("advantage", pa.array([[[0.5]], [[1.0]]]), "list<element: list<element: double>>"),
    ("advantage", pa.array([decimal.Decimal("0.5"), decimal.Decimal("1")]), "decimal128(2, 1)"),
    ("old_logprobs", pa.array([-0.5, -1.0]), "double"),
    ("weight", pa.array([{"w": 1.0}, {"w": 2.0}]), "struct<w: double>"),
    ("weight", pa.array([True, False]), "bool"),
    ("id", pa.array([b"a", b"b"]), "binary"),
    ("id", pa.array([1.0, 2.0]), "double"),
    ("id", pa.array(["a", "b"]).dictionary_encode().cast(pa.dictionary(pa.int8(), pa.binary())),
     "dictionary<values=binary, indices=int8, ordered=0>"),
    ("routed_experts", pa.array([[[0, 1]] * 3, [[1, 0]] * 2]), "list<element: list<element: int64>>"),
    ("routed_experts", pa.array([[[[0.0]]] * 3, [[[1.0]]] * 2]),
     "list<element: list<element: list<element: double>>>"),
])
def test_a_column_of_the_wrong_type_is_one_error(tmp_path, field, column, expected):
    columns = {"tokens": GOOD_TOKENS, field: column}
    text = load_error(tmp_path, pa.table(columns))
    assert text.startswith(f"data.parquet: field '{field}': column type {expected} is not supported; expected ")
    assert "\n" not in text


# ---------------------------------------------------------------------- accepted column types
LIST_KINDS = {
    # name: how a list level of values of type t with n entries per cell is declared
    "large_list": lambda t, n: pa.large_list(t),
    "fixed_size_list": lambda t, n: pa.list_(t, n),
}
if hasattr(pa, "list_view"):  # pyarrow >= 16
    LIST_KINDS.update(list_view=lambda t, n: pa.list_view(t), large_list_view=lambda t, n: pa.large_list_view(t))


@pytest.mark.parametrize("kind", sorted(LIST_KINDS))
def test_every_list_kind_and_dictionaries_read_exactly(tmp_path, kind):
    """Large lists, fixed-size lists and list views (at every level of the routes), narrow and
    half-precision values and dictionary-encoded ids read as the same arrays as the plain
    list<int64> / list<double> / string columns of the same values."""
    level = LIST_KINDS[kind]
    tokens = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    mask = [[0, 1, 1], [0, 0, 1], [0, 1, 0]]
    logprobs = [[0.0, -0.5, -0.25], None, [0.0, -1.0, -2.0]]  # exact in float16
    routes = [[[[t % 4, (t + 1) % 4]] for t in range(3)]] * 3  # 3 tokens x 1 layer x top-2
    ids = ["a", "b", "c"]
    plain = pa.table({"tokens": tokens, "loss_mask": mask, "old_logprobs": logprobs, "routed_experts": routes,
                      "id": ids})
    varied = pa.table({
        "tokens": pa.array(tokens, level(pa.int32(), 3)),
        "loss_mask": pa.array(mask, level(pa.uint8(), 3)),
        "old_logprobs": pa.array(logprobs, level(pa.float16(), 3)),
        "routed_experts": pa.array(routes, level(level(level(pa.int16(), 2), 1), 3)),
        "id": pa.array(ids).dictionary_encode(),
    })
    pq.write_table(plain, tmp_path / "plain.parquet")
    pq.write_table(varied, tmp_path / "varied.parquet")
    expected, loaded = load_samples(tmp_path / "plain.parquet"), load_samples(tmp_path / "varied.parquet")
    assert loaded.ids == expected.ids == ids
    for name in ("offsets", "tokens", "loss_mask", "old_logprobs", "has_old_logprobs", "routed_experts"):
        # The same values in narrower types: equal bit for bit after the reader's casts.
        np.testing.assert_array_equal(getattr(loaded, name), getattr(expected, name), name)


# ---------------------------------------------------------------------- property
INTEGERS = [pa.int8(), pa.int16(), pa.int32(), pa.int64(), pa.uint8(), pa.uint32(), pa.uint64()]
FLOATS = [pa.float16(), pa.float32(), pa.float64()]
OTHERS = [pa.bool_(), pa.string(), pa.large_string(), pa.binary(), pa.null(), pa.decimal128(6, 2),
          pa.date32(), pa.timestamp("ms")]


def containers(inner: st.SearchStrategy) -> st.SearchStrategy:
    """One level of nesting around a type: every list kind, a dictionary, a struct."""
    kinds = [inner.map(pa.list_), inner.map(pa.large_list),
             st.tuples(inner, st.integers(1, 3)).map(lambda a: pa.list_(a[0], a[1])),
             inner.map(lambda t: pa.struct([("a", t)]))]
    if hasattr(pa, "list_view"):
        kinds += [inner.map(pa.list_view), inner.map(pa.large_list_view)]
    return st.one_of(kinds)


def dictionaries(values: st.SearchStrategy) -> st.SearchStrategy:
    return st.tuples(st.sampled_from([pa.int8(), pa.int32()]), values).map(lambda a: pa.dictionary(*a))


def nested_types(depth: int) -> st.SearchStrategy:
    """Types of ``depth`` levels of containers around a scalar or dictionary type."""
    types = st.sampled_from(INTEGERS + FLOATS + OTHERS) | dictionaries(st.sampled_from([pa.string(), pa.int64()]))
    for _ in range(depth):
        types = containers(types)
    return types


ARROW_TYPES = st.integers(0, 3).flatmap(nested_types)
"""Any Arrow type the sample columns could have: scalars, dictionaries, lists of every kind
and structs, nested up to three levels (as deep as ``routed_experts``)."""

# The types the reader accepts (tables of these load often enough for the result to be checked).
LIKELY = {
    "tokens": st.sampled_from(INTEGERS).flatmap(lambda t: st.sampled_from([pa.list_(t), pa.large_list(t)])),
    "loss_mask": st.sampled_from([pa.list_(pa.bool_()), pa.list_(pa.int8())]),
    "advantage": st.sampled_from(FLOATS + [pa.list_(pa.float32())]),
    "old_logprobs": st.just(pa.list_(pa.float32())),
    "ref_logprobs": st.just(pa.large_list(pa.float64())),
    "weight": st.sampled_from(FLOATS + [pa.int32()]),
    "id": st.sampled_from([pa.int64(), pa.string(), pa.dictionary(pa.int32(), pa.string())]),
    "routed_experts": st.just(pa.list_(pa.list_(pa.list_(pa.int16())))),
}


def values(t: pa.DataType, clean: bool = False, length: int = 0) -> st.SearchStrategy:
    """Python values Arrow accepts for a cell of type ``t``: anything (nulls, the type's
    extremes, lists of any length) or, ``clean``, what valid samples hold (no nulls, ids and
    masks 0/1, numbers in [0, 1], outer lists of ``length`` entries and inner ones of 1)."""
    null = st.nothing() if clean else st.none()
    if pa.types.is_dictionary(t):
        return values(t.value_type, clean, length)
    if pa.types.is_fixed_size_list(t):
        return null | st.lists(values(t.value_type, clean, 1), min_size=t.list_size, max_size=t.list_size)
    if hasattr(t, "value_type"):  # the other list kinds
        size = dict(min_size=length, max_size=length) if clean else dict(max_size=4)
        return null | st.lists(values(t.value_type, clean, 1), **size)
    if pa.types.is_struct(t):
        return null | st.fixed_dictionaries({t.field(i).name: values(t.field(i).type, clean)
                                             for i in range(t.num_fields)})
    if pa.types.is_integer(t):
        if clean:
            return st.integers(0, 1)
        info = np.iinfo(t.to_pandas_dtype())
        return null | st.integers(0, 4) | st.sampled_from([int(info.min), int(info.max)])
    if pa.types.is_floating(t):
        return st.floats(0, 1, width=t.bit_width) if clean else null | st.floats(width=t.bit_width)
    if pa.types.is_decimal(t):
        return null | st.decimals(-999, 999, places=2)
    return null | {
        "bool": st.booleans(), "string": st.text(max_size=3), "large_string": st.text(max_size=3),
        "binary": st.binary(max_size=3), "null": st.none(),
        "date32[day]": st.dates(), "timestamp[ms]": st.datetimes(datetime.datetime(1970, 1, 1)),
    }[str(t)]


@st.composite
def sample_tables(draw) -> pa.Table:
    """A table with a ``tokens`` column and some other sample fields, each of a random type
    filled with random values of that type; half of the tables hold only accepted types and
    plausible values, so that loading succeeds often enough for its result to be checked."""
    clean = draw(st.booleans())
    rows, length = draw(st.integers(1, 4)), draw(st.integers(2, 4))
    others = [name for name in KNOWN_FIELDS if name != "tokens"]
    columns = {}
    for name in ["tokens"] + draw(st.lists(st.sampled_from(others), unique=True, max_size=4)):
        column_type = draw(LIKELY[name] if clean else LIKELY[name] | ARROW_TYPES)
        if clean and name == "id":  # unique ids
            cells = list(range(rows)) if pa.types.is_integer(column_type) else [str(row) for row in range(rows)]
        else:
            cells = draw(st.lists(values(column_type, clean, length), min_size=rows, max_size=rows))
        columns[name] = pa.array(cells, type=column_type)
    return pa.table(columns)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sample_tables())
def test_any_column_types_load_or_raise_the_one_line_error(table):
    """Whatever the Arrow types of the sample columns, loading returns a batch (with the file's
    tokens) or raises the project's one-line error naming the file; never another exception."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "samples.parquet"
        try:
            pq.write_table(table, path)
        except pa.ArrowException:  # a table pyarrow itself cannot write (e.g. nulls in dictionaries in structs)
            reject()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                batch = load_samples(path)
        except SampleValidationError as exc:
            text = str(exc)
            assert text.startswith(str(path)) and "\n" not in text, text
            assert exc.field in table.column_names, text  # names the column at fault
            event("refused: column type" if exc.row is None else "refused: a row")
            return
    event("loaded")
    assert batch.num_samples == table.num_rows
    expected = [token for cell in table.column("tokens").to_pylist() for token in cell]
    assert batch.tokens.tolist() == expected
