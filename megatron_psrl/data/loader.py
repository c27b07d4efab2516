"""Reading and writing trajectory samples (JSONL and Parquet), see docs/data-format.md.

    batch = load_samples("rollouts.jsonl", vocab_size=model_vocab, require_advantage=True)

Readers stream: JSONL line by line, Parquet in record batches; every record goes through the
same :class:`~megatron_psrl.data.validation.SampleAccumulator`, which appends it to growing
numpy chunks. Memory is linear in the number of tokens (plus one record in flight), and the
whole file is validated before a :class:`SampleBatch` is returned.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Optional, Tuple, Union

import numpy as np

from megatron_psrl.data.samples import SampleBatch
from megatron_psrl.data.validation import KNOWN_FIELDS, RoutingShape, SampleAccumulator, SampleValidationError
from megatron_psrl.tempfiles import output_mkstemp

PathLike = Union[str, os.PathLike]

JSONL_SUFFIXES = (".jsonl", ".json")
PARQUET_SUFFIXES = (".parquet", ".pq")

PARQUET_BATCH_ROWS = 256
"""Rows per Parquet record batch while reading: small, because one agentic sample can hold
100k+ tokens."""


def _format_of(path: Path) -> str:
    suffix = path.suffix.lower()
    if suffix in JSONL_SUFFIXES:
        return "jsonl"
    if suffix in PARQUET_SUFFIXES:
        return "parquet"
    raise SampleValidationError(
        f"unknown file type {suffix!r}; expected one of "
        f"{', '.join(JSONL_SUFFIXES + PARQUET_SUFFIXES)}",
        source=str(path),
    )


def load_samples(
    path: PathLike,
    vocab_size: Optional[int] = None,
    require_advantage: bool = False,
    kl_required: bool = False,
    progress: bool = False,
    allow_unknown_fields: bool = False,
    routing: Optional[RoutingShape] = None,
) -> SampleBatch:
    """Read and validate a JSONL or Parquet file of samples (format chosen by suffix).

    Args:
        path: ``.jsonl`` (one JSON object per line; blank lines are skipped) or ``.parquet``.
        vocab_size: token ids must lie in ``[0, vocab_size)``; None only checks they fit int32.
        require_advantage: every sample must carry ``advantage`` (training).
        kl_required: every sample must carry ``ref_logprobs`` (KL penalty).
        progress: show a tqdm bar (bytes for JSONL, rows for Parquet).
        allow_unknown_fields: accept a field that looks like a typo of a known one
            (``lossmask``); unrelated extra fields are always accepted (with a warning).
        routing: the model's routing geometry for ``routed_experts`` (router replay); None
            checks routes for consistency only.

    Raises:
        SampleValidationError: on the first problem, naming file, line/row, sample id, field.
    """
    path = Path(path)
    fmt = _format_of(path)
    row_label = "line" if fmt == "jsonl" else "row"
    acc = SampleAccumulator(str(path), row_label, vocab_size, require_advantage, kl_required, allow_unknown_fields,
                            routing)
    records = _read_jsonl(path, acc, progress) if fmt == "jsonl" else _read_parquet(
        path, acc, progress
    )
    for row, record in records:
        acc.add(record, row)
    return acc.finish(metadata={"format": fmt})


def samples_from_dicts(
    records: Iterable[Mapping[str, Any]],
    source: str = "<memory>",
    vocab_size: Optional[int] = None,
    require_advantage: bool = False,
    kl_required: bool = False,
    metadata: Optional[dict] = None,
    allow_unknown_fields: bool = False,
    routing: Optional[RoutingShape] = None,
) -> SampleBatch:
    """Validate in-memory records (same fields and rules as the files; values may be lists,
    numpy arrays or torch tensors) into a :class:`SampleBatch`. Messages name ``source row k``
    (0-based)."""
    acc = SampleAccumulator(source, "row", vocab_size, require_advantage, kl_required, allow_unknown_fields, routing)
    for row, record in enumerate(records):
        if isinstance(record, Mapping):
            record = {k: _plain(v) for k, v in record.items()}
        acc.add(record, row)
    return acc.finish(metadata=metadata)


def _plain(value: Any) -> Any:
    """A torch tensor as numpy (a 0-d one as a Python number); anything else unchanged.
    bfloat16 (as rollout engines return log-probs), which numpy cannot hold, is widened to
    float32 exactly."""
    if type(value).__module__.startswith("torch") and hasattr(value, "detach"):
        value = value.detach().cpu()
        if str(value.dtype) == "torch.bfloat16":  # numpy has no bfloat16
            value = value.float()
        array = value.numpy()
        return array.item() if array.ndim == 0 else array
    return value


# ---------------------------------------------------------------------- JSONL
def _read_jsonl(
    path: Path, acc: SampleAccumulator, progress: bool
) -> Iterator[Tuple[int, Any]]:
    try:
        handle = open(path, "rb")
        total = os.fstat(handle.fileno()).st_size
    except OSError as exc:
        raise acc.file_error(f"cannot read file: {exc.strerror or exc}") from exc
    bar = _progress_bar(progress, total=total, unit="B", desc=path.name)
    with handle:
        line_no = 0
        while True:
            try:
                line = handle.readline()
            except OSError as exc:
                raise acc.file_error(f"cannot read file: {exc.strerror or exc}") from exc
            if not line:
                break
            line_no += 1
            if bar is not None:
                bar.update(len(line))
            if not line.strip():
                continue  # blank lines (e.g. a trailing newline) are not samples
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                reason = f"malformed JSON: {exc.msg} (column {exc.pos + 1})"
                raise acc.row_error(reason, line_no) from None
            except UnicodeDecodeError as exc:
                reason = f"malformed JSON: not UTF-8 ({exc.reason} at byte {exc.start})"
                raise acc.row_error(reason, line_no) from None
            yield line_no, record
    if bar is not None:
        bar.close()


# ---------------------------------------------------------------------- Parquet
def _read_parquet(
    path: Path, acc: SampleAccumulator, progress: bool
) -> Iterator[Tuple[int, Any]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except (OSError, pa.ArrowException) as exc:
        raise acc.file_error(f"cannot read Parquet file: {exc}") from exc
    schema = parquet.schema_arrow
    names = schema.names
    if parquet.metadata.num_rows == 0:
        raise acc.file_error("no samples (empty file)")
    if "tokens" not in names:
        raise acc.error("missing required field (no 'tokens' column)", 0, field="tokens")
    # Unknown columns are not read at all; the accumulator warns about them once.
    unknown = [name for name in names if name not in KNOWN_FIELDS]
    columns = [name for name in names if name in KNOWN_FIELDS]
    # Checked before any row is read: a column of the wrong type is one file-level error
    # naming it, never an exception from deep inside the Arrow accessors.
    read_as = {name: _column_read_type(acc, name, schema.field(name).type) for name in columns}
    bar = _progress_bar(progress, total=parquet.metadata.num_rows, unit="rows", desc=path.name)
    row = 0
    try:
        batches = parquet.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=columns)
        for batch in batches:
            accessors = {name: _ParquetColumn(_as_type(batch.column(name), read_as[name])) for name in columns}
            for i in range(batch.num_rows):
                record = {name: column.get(i) for name, column in accessors.items()}
                for name in unknown:
                    record[name] = None  # only its presence matters (for the warning)
                yield row, record
                row += 1
            if bar is not None:
                bar.update(batch.num_rows)
    except (OSError, pa.ArrowException) as exc:
        raise acc.error(f"cannot read Parquet data: {exc}", row) from exc
    if bar is not None:
        bar.close()


def _value_kind(t) -> str:
    """What Arrow values of type ``t`` are to the validator: ``integer``, ``float``, ``bool``,
    ``string``, ``null`` or ``other``."""
    import pyarrow as pa

    is_string_view = getattr(pa.types, "is_string_view", lambda _: False)  # pyarrow >= 16
    for kind, is_kind in (("integer", pa.types.is_integer), ("float", pa.types.is_floating),
                          ("bool", pa.types.is_boolean), ("null", pa.types.is_null),
                          ("string", lambda u: pa.types.is_string(u) or pa.types.is_large_string(u) or
                           is_string_view(u))):
        if is_kind(t):
            return kind
    return "other"


PARQUET_COLUMN_TYPES = {
    # field: (list depths it may have, the kinds its innermost values may be, the expectation in words)
    "id": ((0,), {"integer", "string"}, "a string or integer column"),
    "tokens": ((1,), {"integer"}, "a list of integer token ids (e.g. list<int32>)"),
    "loss_mask": ((1,), {"integer", "bool"}, "a list of 0/1 integers or booleans (e.g. list<bool>)"),
    "advantage": ((0, 1), {"integer", "float"}, "a number or a list of numbers (e.g. float32 or list<float32>)"),
    "old_logprobs": ((1,), {"integer", "float"}, "a list of numbers (e.g. list<float32>)"),
    "ref_logprobs": ((1,), {"integer", "float"}, "a list of numbers (e.g. list<float32>)"),
    "weight": ((0,), {"integer", "float"}, "a number column (e.g. float32)"),
    "routed_experts": ((3,), {"integer"}, "a list<list<list<integer>>> of expert ids (tokens x MoE layers x top-k)"),
}
"""The Arrow column types the Parquet reader accepts per field, after :func:`_read_type`
(dictionaries decoded, every kind of list read as a list). Integer and floating types of any
width are accepted; whether the values fit (range, finiteness) is checked per row."""


def _is_any_list(t) -> bool:
    """Every Arrow list kind: list, large_list, fixed_size_list and (pyarrow >= 16) list views."""
    import pyarrow as pa

    views = (getattr(pa.types, "is_list_view", None), getattr(pa.types, "is_large_list_view", None))
    return _is_list_type(t) or any(is_view is not None and is_view(t) for is_view in views)


def _read_type(t):
    """The type a column of Arrow type ``t`` is cast to before :class:`_ParquetColumn` reads it:
    dictionary-encoded values decoded, fixed-size lists and list views as large_list (their
    cells as offsets into flat values, which is all the reader handles); list and large_list
    kept. Every such cast is exact."""
    import pyarrow as pa

    if pa.types.is_dictionary(t):
        return _read_type(t.value_type)
    if not _is_any_list(t):
        return t
    field = t.value_field.with_type(_read_type(t.value_type))
    return pa.list_(field) if pa.types.is_list(t) else pa.large_list(field)


def _column_read_type(acc: SampleAccumulator, name: str, column_type):
    """The type column ``name`` is read as (:func:`_read_type`), or the file's one error naming
    the column, its type and what the field needs (:data:`PARQUET_COLUMN_TYPES`). Null-typed
    values pass (a column of nulls is an absent field; null elements of a list are named, with
    their row, by the validator)."""
    read_type = _read_type(column_type)
    depth, leaf = 0, read_type
    while _is_list_type(leaf):
        depth, leaf = depth + 1, leaf.value_type
    depths, kinds, expected = PARQUET_COLUMN_TYPES[name]
    kind = _value_kind(leaf)
    if not ((depth in depths and kind in kinds | {"null"}) or (depth == 0 and kind == "null")):
        raise acc.error(f"column type {column_type} is not supported; expected {expected}", field=name)
    return read_type


def _as_type(array, read_type):
    """``array`` cast to its :func:`_read_type` (a no-op for the usual list<int> columns)."""
    return array if array.type == read_type else array.cast(read_type)


class _ParquetColumn:
    """Per-row access to one column of a record batch without a Python object per token:
    list cells come out as numpy views into the column's flat values. Columns arrive as
    :func:`_column_read_type` admitted and cast them: lists are list or large_list."""

    def __init__(self, array) -> None:
        import pyarrow as pa

        self.is_list = pa.types.is_list(array.type) or pa.types.is_large_list(array.type)
        self.routes = None
        if self.is_list and _is_list_type(array.type.value_type):
            # ``routed_experts``: list<list<list<int>>> (tokens x layers x top-k), flattened once
            self.routes = _NestedRoutes(array)
            return
        if self.is_list:
            self.cell_null = array.is_null().to_numpy(zero_copy_only=False)
            # ``offsets`` index ``values`` (the whole child, also for sliced arrays).
            self.offsets = array.offsets.to_numpy(zero_copy_only=False).astype(np.int64)
            values = array.values
            if values.null_count:
                # Null elements: numpy would turn the ints into NaN floats for every row, so
                # fall back to Python objects (the file is rejected at the row with the null;
                # the rows before it still validate exactly as they would without it).
                self.values = np.empty(len(values), dtype=object)
                for k, value in enumerate(values.to_pylist()):
                    self.values[k] = value
            else:
                self.values = values.to_numpy(zero_copy_only=False)
        else:
            self.cells = array.to_pylist()

    def get(self, i: int) -> Any:
        if self.routes is not None:
            return self.routes.get(i)
        if not self.is_list:
            return self.cells[i]
        if self.cell_null[i]:
            return None
        return self.values[self.offsets[i] : self.offsets[i + 1]]


def _is_list_type(t) -> bool:
    import pyarrow as pa

    return pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)


class _NestedRoutes:
    """Per-row ``[tokens, layers, top-k]`` arrays of a list<list<list<int>>> column, without a
    Python object per id: a cell whose inner lists all have one length is a reshaped numpy
    view; anything else (ragged, nulls) comes out as nested Python lists for the validator to
    name the bad token and layer."""

    def __init__(self, array) -> None:
        # Three levels of list or large_list (what ``_column_read_type`` admits for routes).
        self.array = array
        self.cell_null = array.is_null().to_numpy(zero_copy_only=False)
        self.outer = array.offsets.to_numpy(zero_copy_only=False).astype(np.int64)  # -> tokens
        tokens = array.values
        self.middle = tokens.offsets.to_numpy(zero_copy_only=False).astype(np.int64)
        layers = tokens.values
        self.inner = layers.offsets.to_numpy(zero_copy_only=False).astype(np.int64)
        self.clean = tokens.null_count == 0 and layers.null_count == 0 and layers.values.null_count == 0
        self.ids = layers.values.to_numpy(zero_copy_only=False) if self.clean else None

    def get(self, i: int) -> Any:
        if self.cell_null[i]:
            return None
        a, b = int(self.outer[i]), int(self.outer[i + 1])
        if self.clean and b > a:
            layer_counts = np.diff(self.middle[a:b + 1])
            la, lb = int(self.middle[a]), int(self.middle[b])
            id_counts = np.diff(self.inner[la:lb + 1])
            if (layer_counts == layer_counts[0]).all() and id_counts.size and (id_counts == id_counts[0]).all():
                start, stop = int(self.inner[la]), int(self.inner[lb])
                return self.ids[start:stop].reshape(b - a, int(layer_counts[0]), int(id_counts[0]))
        return self.array[i].as_py()


def _progress_bar(enabled: bool, total: int, unit: str, desc: str):
    # A bar only on a terminal: redrawn lines would corrupt a log file.
    if not enabled or not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit=unit, unit_scale=True, desc=desc, leave=False)


# ---------------------------------------------------------------------- writing
def _sample_records(batch: SampleBatch) -> Iterator[dict]:
    """One JSON-ready dict per sample; a per-token advantage that is constant over the sample
    is written as a scalar (how per-sample advantages are stored after broadcasting)."""
    for s in range(batch.num_samples):
        sl = batch.sample_slice(s)
        sample_id = batch.ids[s]
        record = {
            "id": sample_id if isinstance(sample_id, str) else int(sample_id),
            "tokens": batch.tokens[sl].tolist(),
            "loss_mask": batch.loss_mask[sl].astype(np.int8).tolist(),
        }
        if batch.advantages is not None:
            adv = batch.advantages[sl]
            record["advantage"] = float(adv[0]) if (adv == adv[0]).all() else adv.tolist()
        if batch.has_old_logprobs is not None and batch.has_old_logprobs[s]:
            record["old_logprobs"] = batch.old_logprobs[sl].tolist()
        if batch.has_ref_logprobs is not None and batch.has_ref_logprobs[s]:
            record["ref_logprobs"] = batch.ref_logprobs[sl].tolist()
        record["weight"] = float(batch.weights[s])
        if batch.routed_experts is not None:
            routes = batch.routed_experts[sl]
            if (routes[-1] < 0).all():  # no route for the final token: written one route short
                routes = routes[:-1]
            record["routed_experts"] = routes.tolist()
        yield record


def write_samples(batch: SampleBatch, path: PathLike) -> Path:
    """Write ``batch`` as JSONL or Parquet (by suffix), atomically: the data goes to a
    temporary file in the same directory that is renamed over ``path`` only when complete.
    Reading the file back gives the same arrays (float32 values round-trip exactly)."""
    path = Path(path)
    fmt = _format_of(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Not tempfile.mkstemp: its 0600 would survive the rename (see megatron_psrl.tempfiles).
    fd, tmp_name = output_mkstemp(str(path.parent), prefix=f".{path.name}.", suffix=".tmp")
    try:
        if fmt == "jsonl":
            with os.fdopen(fd, "w", encoding="utf-8") as handle:
                for record in _sample_records(batch):
                    handle.write(json.dumps(record, separators=(",", ":")))
                    handle.write("\n")
        else:
            os.close(fd)
            _write_parquet(batch, tmp_name)
        os.replace(tmp_name, path)
    except BaseException:
        if os.path.exists(tmp_name):
            os.unlink(tmp_name)
        raise
    return path


def _write_parquet(batch: SampleBatch, path: str) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    offsets = batch.offsets
    # 32-bit list offsets are the most widely readable; switch to large lists past 2^31.
    large = offsets[-1] >= np.iinfo(np.int32).max
    list_type = pa.LargeListArray if large else pa.ListArray
    arrow_offsets = pa.array(offsets if large else offsets.astype(np.int32))

    def token_list(values: np.ndarray, mask: Optional[np.ndarray] = None):
        return list_type.from_arrays(
            arrow_offsets, pa.array(values), mask=None if mask is None else pa.array(mask)
        )

    ids = batch.ids
    if all(isinstance(i, str) for i in ids):
        id_column = pa.array(ids, type=pa.string())
    elif not any(isinstance(i, str) for i in ids):
        id_column = pa.array([int(i) for i in ids], type=pa.int64())
    else:
        # A Parquet column has one type: mixed ids become strings; refuse if that collides.
        as_text = [str(i) for i in ids]
        if len(set(as_text)) != len(as_text):
            raise ValueError(
                "sample ids mix strings and integers that collide as strings (e.g. 3 and '3'); "
                "Parquet needs one id type"
            )
        id_column = pa.array(as_text, type=pa.string())

    columns = {
        "id": id_column,
        "tokens": token_list(batch.tokens),
        "loss_mask": token_list(batch.loss_mask),
    }
    if batch.advantages is not None:
        adv = batch.advantages
        first = adv[offsets[:-1]]
        per_sample = bool((adv == np.repeat(first, batch.lengths)).all())
        columns["advantage"] = pa.array(first) if per_sample else token_list(adv)
    for name, flags in (
        ("old_logprobs", batch.has_old_logprobs),
        ("ref_logprobs", batch.has_ref_logprobs),
    ):
        values = getattr(batch, name)
        if values is not None:
            columns[name] = token_list(values, mask=~flags)
    columns["weight"] = pa.array(batch.weights)
    if batch.routed_experts is not None:
        columns["routed_experts"] = _routes_column(batch)
    pq.write_table(pa.table(columns), path, row_group_size=4096)


def _routes_column(batch: SampleBatch):
    """list<list<list<int16>>> (tokens x layers x top-k); a sample without a final route is one
    token shorter, as rollout engines return it."""
    import pyarrow as pa

    def lists(offsets: np.ndarray, values):
        large = offsets[-1] >= np.iinfo(np.int32).max  # 64-bit offsets only where needed
        kind = pa.LargeListArray if large else pa.ListArray
        return kind.from_arrays(pa.array(offsets if large else offsets.astype(np.int32)), values)

    routes = batch.routed_experts  # [N, L, k]
    _, layers, topk = routes.shape
    keep = ~(routes < 0).all(axis=(1, 2))  # rows of -1 (missing final routes) are not written
    kept = routes[keep]
    token_offsets = np.zeros(batch.num_samples + 1, dtype=np.int64)
    np.cumsum(np.add.reduceat(keep.astype(np.int64), batch.offsets[:-1]), out=token_offsets[1:])
    inner = lists(np.arange(0, kept.size + 1, topk, dtype=np.int64), pa.array(kept.reshape(-1)))
    middle = lists(np.arange(0, kept.shape[0] * layers + 1, layers, dtype=np.int64), inner)
    return lists(token_offsets, middle)
