"""Validation of trajectory samples (the data contract of docs/data-format.md).

Every reader (JSONL, Parquet, in-memory dicts) hands one raw record at a time to a
:class:`SampleAccumulator`, which checks it completely, fills in the defaults and appends it
to growing columnar chunks. Nothing is returned before the last record has been checked, so a
bad sample can never leave a half-built batch behind.

Every problem raises one :class:`SampleValidationError` whose message names the source, the
line (JSONL, 1-based) or row (Parquet and in-memory records, 0-based), the sample id and the
field, e.g.::

    data.jsonl line 7 (sample id 'abc'): field 'loss_mask': length 12 != len(tokens) 13

Checks are per sample and vectorised over its tokens (numpy); the only per-token Python work
is ``set(map(type, values))`` on JSON lists, which runs at C speed and is what makes a stray
``true`` or ``1.5`` in a token list detectable at all.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Dict, List, Mapping, Optional

import numpy as np

from megatron_psrl.data.samples import SampleBatch, SampleId
from megatron_psrl.errors import ConfigurationError, PsrlError

KNOWN_FIELDS = ("id", "tokens", "loss_mask", "advantage", "old_logprobs", "ref_logprobs", "weight")
"""The fields of the data contract (docs/data-format.md); anything else is ignored with an
:class:`UnknownFieldWarning`."""

MAX_TOKEN_ID = np.iinfo(np.int32).max
"""Token ids are stored as int32, so without a vocabulary size they must be <= this."""

FLUSH_TOKENS = 1 << 20
"""Per-sample arrays are concatenated into one chunk every this many tokens, which keeps the
number of live Python objects bounded by the chunk, not by the file."""

_INT_TYPES = (int, np.integer)
_FLOAT_TYPES = (int, float, np.integer, np.floating)
_BOOL_TYPES = (bool, np.bool_)


class SampleValidationError(PsrlError, ValueError):
    """A sample (or the file holding it) violates the data contract.

    The message is ``"<source> <line|row> <k> (sample id <id>): field '<field>': <reason>"``;
    the parts that are unknown (e.g. no sample for an empty file) are left out. The parts are
    also available as attributes for programs that handle the error.
    """

    def __init__(
        self,
        reason: str,
        *,
        source: str,
        row_label: Optional[str] = None,
        row: Optional[int] = None,
        sample_id: Any = None,
        has_sample_id: bool = False,
        field: Optional[str] = None,
    ) -> None:
        self.reason = reason
        """What is wrong, without the location."""
        self.source = source
        """File path (or ``<memory>``)."""
        self.row_label = row_label
        """``"line"`` (JSONL, 1-based) or ``"row"`` (Parquet / in-memory, 0-based)."""
        self.row = row
        """The line or row number, None for file-level problems."""
        self.sample_id = sample_id if has_sample_id else None
        """The sample id (given or defaulted), None when unknown."""
        self.field = field
        """The offending field, None for record-level problems."""
        where = str(source)
        if row is not None:
            where += f" {row_label} {row}"
        if has_sample_id:
            where += f" (sample id {sample_id!r})"
        if field is not None:
            where += f": field '{field}'"
        super().__init__(f"{where}: {reason}")


class UnknownFieldWarning(UserWarning):
    """A record carries fields outside the data contract; they are ignored (warned once per
    source, so that frameworks can attach their own metadata such as rewards or prompts)."""


def likely_field(name: str) -> Optional[str]:
    """The known field an unknown name is probably a typo of (``lossmask``, ``advantages``)."""
    import difflib

    match = difflib.get_close_matches(name.lower(), KNOWN_FIELDS, n=1, cutoff=0.8)
    return match[0] if match else None


def _describe(value: Any) -> str:
    """``float 1.5``, ``str 'a'``, ... for error messages (kept short)."""
    text = repr(value)
    if len(text) > 40:
        text = text[:37] + "..."
    return f"{type(value).__name__} {text}"


def _is_int(value: Any) -> bool:
    return isinstance(value, _INT_TYPES) and not isinstance(value, _BOOL_TYPES)


def _is_number(value: Any) -> bool:
    return isinstance(value, _FLOAT_TYPES) and not isinstance(value, _BOOL_TYPES)


def _types_ok(types: set, allowed: tuple, forbidden: tuple = _BOOL_TYPES) -> bool:
    return all(issubclass(t, allowed) and not issubclass(t, forbidden) for t in types)


def _first_bad(values, ok) -> int:
    """Index of the first element failing ``ok`` (only called on the error path)."""
    for i, v in enumerate(values):
        if not ok(v):
            return i
    return -1  # pragma: no cover - callers know there is one


class SampleAccumulator:
    """Validates raw records one at a time and accumulates them into a :class:`SampleBatch`.

    A record is a mapping from field name to value; values are what ``json.loads`` produces
    (lists of Python numbers) or numpy arrays (Parquet columns, synthetic generators).
    ``None`` means "field absent" for optional fields (JSON ``null``, a Parquet null).
    """

    def __init__(
        self,
        source: str,
        row_label: str,
        vocab_size: Optional[int] = None,
        require_advantage: bool = False,
        kl_required: bool = False,
        allow_unknown_fields: bool = False,
    ) -> None:
        if vocab_size is not None and not (0 < int(vocab_size) <= MAX_TOKEN_ID + 1):
            raise ConfigurationError(f"vocab_size must be in [1, {MAX_TOKEN_ID + 1}], got {vocab_size}")
        self.source = str(source)
        self.row_label = row_label
        self.vocab_size = None if vocab_size is None else int(vocab_size)
        self.require_advantage = require_advantage
        self.kl_required = kl_required
        self.allow_unknown_fields = allow_unknown_fields

        # Per-sample columns (Python lists: one entry per sample is fine).
        self.ids: List[SampleId] = []
        self.rows: List[int] = []
        self.weights: List[float] = []
        self.lengths: List[int] = []
        self.has_old: List[bool] = []
        self.has_ref: List[bool] = []
        self._first_row_of_id: Dict[SampleId, int] = {}
        # Whether samples carry an advantage: decided by the first sample, then enforced.
        self._advantage_present: Optional[bool] = None
        self._unknown_fields: set = set()
        self._unknown_first_row: Optional[int] = None

        # Per-token columns, in chunks.
        self.tokens = _ChunkedColumn(np.int32)
        self.loss_mask = _ChunkedColumn(np.bool_)
        self.advantages = _ChunkedColumn(np.float32)
        self.old_logprobs = _ChunkedColumn(np.float32)
        self.ref_logprobs = _ChunkedColumn(np.float32)

    # ------------------------------------------------------------------ errors
    def error(
        self, reason: str, row: Optional[int] = None, *, sample_id: Any = None,
        has_sample_id: bool = False, field: Optional[str] = None,
    ) -> SampleValidationError:
        return SampleValidationError(
            reason, source=self.source, row_label=self.row_label if row is not None else None,
            row=row, sample_id=sample_id, has_sample_id=has_sample_id, field=field,
        )

    def file_error(self, reason: str) -> SampleValidationError:
        """A problem with the whole source (unreadable, empty, missing column)."""
        return SampleValidationError(reason, source=self.source)

    def row_error(self, reason: str, row: int) -> SampleValidationError:
        """A problem with a record whose sample id is unknown (e.g. malformed JSON)."""
        return self.error(reason, row)

    # ------------------------------------------------------------------ intake
    @property
    def num_samples(self) -> int:
        return len(self.ids)

    def add(self, record: Mapping[str, Any], row: int) -> None:
        """Validate one record (found at ``row`` of the source) and append it."""
        if not isinstance(record, Mapping):
            raise self.row_error(f"expected a JSON object (mapping), got {_describe(record)}", row)

        # ---- id (first: every later message names it)
        sample_id = record.get("id")
        if sample_id is None:
            sample_id = self.num_samples
        elif isinstance(sample_id, (str, np.str_)):
            sample_id = str(sample_id)
        elif _is_int(sample_id):
            sample_id = int(sample_id)
        else:
            raise self.error(
                f"must be a string or an integer, got {_describe(sample_id)}", row, field="id"
            )

        def fail(field: str, reason: str) -> SampleValidationError:
            return self.error(reason, row, sample_id=sample_id, has_sample_id=True, field=field)

        if sample_id in self._first_row_of_id:
            first = self._first_row_of_id[sample_id]
            raise fail("id", f"duplicate id (first used at {self.row_label} {first})")

        unknown = record.keys() - KNOWN_FIELDS
        if unknown:
            if not self.allow_unknown_fields:
                for name in sorted(map(str, unknown)):
                    likely = likely_field(name)
                    if likely is not None and likely not in record:
                        raise fail(name, f"unknown field; did you mean {likely!r}? (a data file may carry other "
                                         "fields with --allow-unknown-fields)")
            if self._unknown_first_row is None:
                self._unknown_first_row = row
            self._unknown_fields |= set(map(str, unknown))

        # ---- tokens
        raw_tokens = record.get("tokens")
        if raw_tokens is None:
            raise fail("tokens", "missing required field")
        tokens = _int_array(raw_tokens, lambda reason: fail("tokens", reason))
        n = int(tokens.shape[0])
        if n < 2:
            raise fail("tokens", f"a sample needs at least 2 tokens, got {n}")
        low, high = int(tokens.min()), int(tokens.max())
        limit = self.vocab_size if self.vocab_size is not None else MAX_TOKEN_ID + 1
        if low < 0 or high >= limit:
            bad = int(np.flatnonzero((tokens < 0) | (tokens >= limit))[0])
            bound = f"vocab_size {self.vocab_size}" if self.vocab_size is not None else "int32"
            raise fail("tokens", f"token id {int(tokens[bad])} at position {bad} is outside "
                                 f"[0, {limit}) ({bound})")

        # ---- loss_mask (default: every token but the first)
        raw_mask = record.get("loss_mask")
        if raw_mask is None:
            loss_mask = np.ones(n, dtype=np.bool_)
            loss_mask[0] = False
        else:
            loss_mask = _mask_array(raw_mask, lambda reason: fail("loss_mask", reason))
            _check_length(loss_mask, n, lambda reason: fail("loss_mask", reason))
            if loss_mask[0]:
                raise fail("loss_mask", "loss on token 0 (it has no context to be predicted "
                                        "from); loss_mask[0] must be 0")

        # ---- advantage (scalar: broadcast; list: per token, only loss positions matter)
        raw_adv = record.get("advantage")
        advantage: Optional[np.ndarray] = None
        if raw_adv is None:
            if self.require_advantage:
                raise fail("advantage", "missing (required for training)")
        elif _is_scalar(raw_adv):
            value = _float_scalar(raw_adv, lambda reason: fail("advantage", reason))
            advantage = np.full(n, value, dtype=np.float32)
        else:
            advantage = _float_array(raw_adv, lambda reason: fail("advantage", reason))
            _check_length(advantage, n, lambda reason: fail("advantage", reason))
            _check_finite_where(advantage, loss_mask, lambda reason: fail("advantage", reason))
        present = advantage is not None
        if self._advantage_present is None:
            self._advantage_present = present
        elif present != self._advantage_present:
            first_row = self.rows[0]
            state = "carries one" if self._advantage_present else "has none"
            raise fail("advantage", f"{'missing' if not present else 'given'}, but the first "
                                    f"sample ({self.row_label} {first_row}) {state}; either every "
                                    "sample carries an advantage or none does")

        # ---- old / ref log-probs (optional per sample; only loss positions matter)
        logprobs = {}
        for field in ("old_logprobs", "ref_logprobs"):
            raw = record.get(field)
            if raw is None:
                if field == "ref_logprobs" and self.kl_required:
                    raise fail(field, "missing (required by the KL penalty)")
                logprobs[field] = None
                continue
            values = _float_array(raw, lambda reason, f=field: fail(f, reason))
            _check_length(values, n, lambda reason, f=field: fail(f, reason))
            _check_finite_where(values, loss_mask, lambda reason, f=field: fail(f, reason))
            logprobs[field] = values

        # ---- weight
        raw_weight = record.get("weight")
        if raw_weight is None:
            weight = 1.0
        else:
            if not _is_scalar(raw_weight):
                raise fail("weight", f"must be a number, got {_describe(raw_weight)}")
            weight = _float_scalar(raw_weight, lambda reason: fail("weight", reason))
            if weight < 0:
                raise fail("weight", f"must be >= 0, got {weight}")

        # ---- append (only now: a rejected record leaves no trace)
        self._first_row_of_id[sample_id] = row
        self.ids.append(sample_id)
        self.rows.append(int(row))
        self.weights.append(weight)
        self.lengths.append(n)
        self.tokens.append(tokens.astype(np.int32), n)
        self.loss_mask.append(loss_mask, n)
        self.advantages.append(advantage, n)
        self.has_old.append(logprobs["old_logprobs"] is not None)
        self.has_ref.append(logprobs["ref_logprobs"] is not None)
        self.old_logprobs.append(logprobs["old_logprobs"], n)
        self.ref_logprobs.append(logprobs["ref_logprobs"], n)

    # ------------------------------------------------------------------ result
    def finish(self, metadata: Optional[dict] = None) -> SampleBatch:
        """The validated batch. Raises if no sample was added; warns about unknown fields."""
        if self.num_samples == 0:
            raise self.file_error("no samples (empty file)")
        if self._unknown_fields:
            warnings.warn(
                f"{self.source}: ignoring unknown field(s) {sorted(self._unknown_fields)} "
                f"(first at {self.row_label} {self._unknown_first_row}); known fields: "
                f"{', '.join(KNOWN_FIELDS)}",
                UnknownFieldWarning,
                stacklevel=3,
            )
        offsets = np.zeros(self.num_samples + 1, dtype=np.int64)
        np.cumsum(np.asarray(self.lengths, dtype=np.int64), out=offsets[1:])
        has_old = np.asarray(self.has_old, dtype=np.bool_)
        has_ref = np.asarray(self.has_ref, dtype=np.bool_)
        return SampleBatch(
            ids=list(self.ids),
            offsets=offsets,
            tokens=self.tokens.result(),
            loss_mask=self.loss_mask.result(),
            advantages=self.advantages.result() if self._advantage_present else None,
            old_logprobs=self.old_logprobs.result() if has_old.any() else None,
            has_old_logprobs=has_old if has_old.any() else None,
            ref_logprobs=self.ref_logprobs.result() if has_ref.any() else None,
            has_ref_logprobs=has_ref if has_ref.any() else None,
            weights=np.asarray(self.weights, dtype=np.float32),
            source=self.source,
            source_rows=np.asarray(self.rows, dtype=np.int64),
            row_label=self.row_label,
            metadata=dict(metadata or {}),
        )


class _ChunkedColumn:
    """A per-token column that grows sample by sample with bounded overhead.

    Pending per-sample arrays are concatenated into one chunk every :data:`FLUSH_TOKENS`
    tokens. Samples without the field (``None``) cost nothing until the first sample that has
    it; from then on they are stored as zeros.
    """

    def __init__(self, dtype) -> None:
        self.dtype = np.dtype(dtype)
        self.chunks: List[np.ndarray] = []
        self.pending: List[np.ndarray] = []
        self.pending_tokens = 0
        self.missing_prefix = 0  # tokens seen before the first sample with the field
        self.present = False

    def append(self, values: Optional[np.ndarray], n: int) -> None:
        if values is None:
            if not self.present:
                self.missing_prefix += n
                return
            values = np.zeros(n, dtype=self.dtype)
        elif not self.present:
            self.present = True
            if self.missing_prefix:
                self.chunks.append(np.zeros(self.missing_prefix, dtype=self.dtype))
        self.pending.append(np.asarray(values, dtype=self.dtype))
        self.pending_tokens += n
        if self.pending_tokens >= FLUSH_TOKENS:
            self._flush()

    def _flush(self) -> None:
        if self.pending:
            self.chunks.append(np.concatenate(self.pending))
            self.pending = []
            self.pending_tokens = 0

    def result(self) -> np.ndarray:
        self._flush()
        if not self.present:
            return np.zeros(self.missing_prefix, dtype=self.dtype)
        if len(self.chunks) == 1:
            return self.chunks[0]
        return np.concatenate(self.chunks)


# ---------------------------------------------------------------------- value conversion
def _is_scalar(value: Any) -> bool:
    return not isinstance(value, (list, tuple, np.ndarray)) or (
        isinstance(value, np.ndarray) and value.ndim == 0
    )


def _check_length(values: np.ndarray, n: int, fail) -> None:
    if values.shape[0] != n:
        raise fail(f"length {values.shape[0]} != len(tokens) {n}")


def _check_finite_where(values: np.ndarray, loss_mask: np.ndarray, fail) -> None:
    """Non-finite values are an error where the loss uses them (loss_mask 1) and are replaced
    by 0 elsewhere, so that no NaN ever reaches a kernel through an ignored entry."""
    finite = np.isfinite(values)
    if finite.all():
        return
    bad = ~finite & loss_mask
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise fail(f"value {float(values[i])} at position {i} is not finite (in float32) "
                   "where loss_mask is 1")
    values[~finite] = 0.0


def _int_array(value: Any, fail) -> np.ndarray:
    """A 1-D int64 array from a list of integers or an integer numpy array.

    Floats are rejected even when integral (``1.0``): a float token id means the producer
    converted ids lossily somewhere, which is a bug worth surfacing. Booleans are rejected.
    """
    if isinstance(value, np.ndarray):
        if value.ndim != 1:
            raise fail(f"must be a flat list of integers, got an array of shape {value.shape}")
        if value.dtype.kind == "u" and value.size and int(value.max()) > np.iinfo(np.int64).max:
            raise fail(f"token id {int(value.max())} is out of range")
        if value.dtype.kind in "iu":
            return value.astype(np.int64, copy=False)
        if value.dtype == object:
            return _int_array(value.tolist(), fail)
        raise fail(f"must be a list of integers, got an array of dtype {value.dtype}")
    if not isinstance(value, (list, tuple)):
        raise fail(f"must be a list of integers, got {_describe(value)}")
    if not _types_ok(set(map(type, value)), _INT_TYPES):
        i = _first_bad(value, _is_int)
        raise fail(f"element {i} is {_describe(value[i])}; token ids must be integers")
    try:
        return np.array(value, dtype=np.int64)
    except OverflowError:
        i = _first_bad(value, lambda v: -(2**63) <= v < 2**63)
        raise fail(f"token id {value[i]} at position {i} is out of range") from None


def _mask_array(value: Any, fail) -> np.ndarray:
    """A 1-D bool array from a list of 0/1 integers or booleans (or such a numpy array)."""
    if isinstance(value, np.ndarray):
        if value.ndim != 1:
            raise fail(f"must be a flat list of 0/1, got an array of shape {value.shape}")
        if value.dtype == np.bool_:
            return value
        if value.dtype == object:
            return _mask_array(value.tolist(), fail)
        if value.dtype.kind not in "iu":
            raise fail(f"must be a list of 0/1 or booleans, got an array of dtype {value.dtype}")
        ints = value
    else:
        if not isinstance(value, (list, tuple)):
            raise fail(f"must be a list of 0/1 or booleans, got {_describe(value)}")
        if not _types_ok(set(map(type, value)), _INT_TYPES + _BOOL_TYPES, forbidden=()):
            i = _first_bad(value, lambda v: isinstance(v, _INT_TYPES + _BOOL_TYPES))
            raise fail(f"element {i} is {_describe(value[i])}; expected 0/1 or a boolean")
        try:
            ints = np.array(value, dtype=np.int64)
        except OverflowError:
            i = _first_bad(value, lambda v: v in (0, 1))
            raise fail(f"element {i} is {value[i]}; expected 0/1 or a boolean") from None
    bad = (ints != 0) & (ints != 1)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise fail(f"element {i} is {int(ints[i])}; expected 0/1 or a boolean")
    return ints.astype(np.bool_)


def _float_array(value: Any, fail) -> np.ndarray:
    """A 1-D float32 array from a list of numbers (ints allowed, booleans and nulls not)."""
    if isinstance(value, np.ndarray):
        if value.ndim != 1:
            raise fail(f"must be a flat list of numbers, got an array of shape {value.shape}")
        if value.dtype == object:
            return _float_array(value.tolist(), fail)
        if value.dtype.kind not in "fiu":
            raise fail(f"must be a list of numbers, got an array of dtype {value.dtype}")
        with np.errstate(over="ignore"):
            return value.astype(np.float32)  # always a copy: callers may sanitise in place
    if not isinstance(value, (list, tuple)):
        raise fail(f"must be a number or a list of numbers, got {_describe(value)}")
    if not _types_ok(set(map(type, value)), _FLOAT_TYPES):
        i = _first_bad(value, _is_number)
        raise fail(f"element {i} is {_describe(value[i])}; expected a number")
    try:
        as_float = np.array(value, dtype=np.float64)
    except OverflowError:
        i = _first_bad(value, lambda v: abs(v) < 2**1000)
        raise fail(f"element {i} = {value[i]} is not finite in float32") from None
    with np.errstate(over="ignore"):
        return as_float.astype(np.float32)


def _float_scalar(value: Any, fail) -> float:
    """A finite (in float32) Python float from an int or float (booleans rejected)."""
    if isinstance(value, np.ndarray):
        value = value.item()
    if not _is_number(value):
        raise fail(f"must be a number, got {_describe(value)}")
    try:
        as_float = float(value)
    except OverflowError:
        raise fail(f"{value} is not finite in float32") from None
    with np.errstate(over="ignore"):
        as_float32 = float(np.float32(as_float))
    if not math.isfinite(as_float32):
        raise fail(f"{value!r} is not finite (in float32)")
    return as_float32


def check_max_sample_length(batch, max_length: int, why: str, hint: Optional[str] = None) -> None:
    """Refuse the first sample longer than ``max_length`` tokens (e.g. a sliding window);
    ``hint`` says what the user can do about it."""
    import numpy as np

    too_long = np.flatnonzero(batch.lengths > max_length)
    if len(too_long):
        s = int(too_long[0])
        raise SampleValidationError(
            f"length {int(batch.lengths[s])} exceeds {why} ({max_length} tokens)" + (f"; {hint}" if hint else ""),
            source=batch.source, row_label=batch.row_label, row=int(batch.source_rows[s]),
            sample_id=batch.ids[s], has_sample_id=True, field="tokens",
        )
