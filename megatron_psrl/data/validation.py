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
from dataclasses import dataclass
from itertools import chain
from typing import Any, Dict, List, Mapping, Optional

import numpy as np

from megatron_psrl.data.samples import SampleBatch, SampleId
from megatron_psrl.errors import ConfigurationError, PsrlError

KNOWN_FIELDS = ("id", "tokens", "loss_mask", "advantage", "old_logprobs", "ref_logprobs", "weight",
                "routed_experts")
"""The fields of the data contract (docs/data-format.md); anything else is ignored with an
:class:`UnknownFieldWarning`."""

MAX_TOKEN_ID = np.iinfo(np.int32).max
"""Token ids are stored as int32, so without a vocabulary size they must be <= this."""

FLUSH_TOKENS = 1 << 20
"""Per-sample arrays are concatenated into one chunk every this many tokens, which keeps the
number of live Python objects bounded by the chunk, not by the file."""

MAX_EXPERT_ID = np.iinfo(np.int16).max
"""Expert ids are stored as int16 (as verl passes them), so without a model they must be <= this."""

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


@dataclass(frozen=True)
class RoutingShape:
    """What ``routed_experts`` must look like for a model: ``[tokens, num_layers, topk]`` expert
    ids in ``[0, num_experts)``. ``num_experts == 0``: the model has no mixture-of-experts layer
    (routes are refused). Built from a model by :func:`megatron_psrl.model.moe.routing_shape`."""

    num_layers: int
    """MoE layers of the model (the routes' second dimension), in layer order."""
    topk: int
    """Experts per token (``num_experts_per_tok``)."""
    num_experts: int
    """Experts per MoE layer; 0 for a dense model."""
    model: str = "model"
    """How messages name the model (e.g. ``dense llama model``)."""

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0


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
        routing: Optional[RoutingShape] = None,
    ) -> None:
        if vocab_size is not None and not (0 < int(vocab_size) <= MAX_TOKEN_ID + 1):
            raise ConfigurationError(f"vocab_size must be in [1, {MAX_TOKEN_ID + 1}], got {vocab_size}")
        self.source = str(source)
        self.row_label = row_label
        self.vocab_size = None if vocab_size is None else int(vocab_size)
        self.require_advantage = require_advantage
        self.kl_required = kl_required
        self.allow_unknown_fields = allow_unknown_fields
        self.routing = routing
        """The model's routing geometry (None: routes are checked for consistency only)."""

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
        # Whether samples carry routes, and their (layers, top-k): decided by the first sample.
        self._routes_present: Optional[bool] = None
        self._routes_shape: Optional[tuple] = None
        self._unknown_fields: set = set()
        self._unknown_first_row: Optional[int] = None

        # Per-token columns, in chunks.
        self.tokens = _ChunkedColumn(np.int32)
        self.loss_mask = _ChunkedColumn(np.bool_)
        self.advantages = _ChunkedColumn(np.float32)
        self.old_logprobs = _ChunkedColumn(np.float32)
        self.ref_logprobs = _ChunkedColumn(np.float32)
        self.routed_experts = _ChunkedColumn(np.int16)  # [n, L, k] per sample (all or none)

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
        sample_id = self._sample_id(record, row)  # first: every later message names it

        def fail(field: str, reason: str) -> SampleValidationError:
            return self.error(reason, row, sample_id=sample_id, has_sample_id=True, field=field)

        if sample_id in self._first_row_of_id:
            first = self._first_row_of_id[sample_id]
            raise fail("id", f"duplicate id (first used at {self.row_label} {first})")
        self._note_unknown_fields(record, row, fail)
        tokens = self._tokens(record.get("tokens"), fail)
        n = int(tokens.shape[0])
        loss_mask = self._loss_mask(record.get("loss_mask"), n, fail)
        advantage = self._advantage(record.get("advantage"), n, loss_mask, fail)
        logprobs = {field: self._logprobs(field, record.get(field), n, loss_mask, fail)
                    for field in ("old_logprobs", "ref_logprobs")}
        weight = self._weight(record.get("weight"), fail)
        routes = self._routes(record.get("routed_experts"), n, row, fail)  # router replay: all or none

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
        if routes is not None:
            self.routed_experts.append(routes, n)

    def _sample_id(self, record: Mapping[str, Any], row: int) -> Any:
        """The record's id: a string or an integer (default: its index among the samples)."""
        sample_id = record.get("id")
        if sample_id is None:
            return self.num_samples
        if isinstance(sample_id, (str, np.str_)):
            return str(sample_id)
        if _is_int(sample_id):
            return int(sample_id)
        raise self.error(f"must be a string or an integer, got {_describe(sample_id)}", row, field="id")

    def _note_unknown_fields(self, record: Mapping[str, Any], row: int, fail) -> None:
        """Fields the format does not know: refused where one looks like a misspelt known field
        (unless allowed), else remembered for one warning."""
        unknown = record.keys() - KNOWN_FIELDS
        if not unknown:
            return
        if not self.allow_unknown_fields:
            for name in sorted(map(str, unknown)):
                likely = likely_field(name)
                if likely is not None and likely not in record:
                    raise fail(name, f"unknown field; did you mean {likely!r}? (a data file may carry other "
                                     "fields with --allow-unknown-fields)")
        if self._unknown_first_row is None:
            self._unknown_first_row = row
        self._unknown_fields |= set(map(str, unknown))

    def _tokens(self, raw_tokens: Any, fail) -> np.ndarray:
        """The token ids: at least 2, each inside the vocabulary (or int32)."""
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
        return tokens

    @staticmethod
    def _loss_mask(raw_mask: Any, n: int, fail) -> np.ndarray:
        """The loss mask (default: every token but the first, which nothing predicts)."""
        if raw_mask is None:
            loss_mask = np.ones(n, dtype=np.bool_)
            loss_mask[0] = False
            return loss_mask
        loss_mask = _mask_array(raw_mask, lambda reason: fail("loss_mask", reason))
        _check_length(loss_mask, n, lambda reason: fail("loss_mask", reason))
        if loss_mask[0]:
            raise fail("loss_mask", "loss on token 0 (it has no context to be predicted "
                                    "from); loss_mask[0] must be 0")
        return loss_mask

    def _advantage(self, raw_adv: Any, n: int, loss_mask: np.ndarray, fail) -> Optional[np.ndarray]:
        """The advantage per token (a scalar is broadcast; only loss positions matter); every
        sample carries one or none does."""
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
        return advantage

    def _logprobs(self, field: str, raw: Any, n: int, loss_mask: np.ndarray, fail) -> Optional[np.ndarray]:
        """Old or reference log-probs (optional per sample; only loss positions matter)."""
        if raw is None:
            if field == "ref_logprobs" and self.kl_required:
                raise fail(field, "missing (required by the KL penalty)")
            return None
        values = _float_array(raw, lambda reason: fail(field, reason))
        _check_length(values, n, lambda reason: fail(field, reason))
        _check_finite_where(values, loss_mask, lambda reason: fail(field, reason))
        return values

    @staticmethod
    def _weight(raw_weight: Any, fail) -> float:
        """The sample's weight: a number >= 0 (default 1)."""
        if raw_weight is None:
            return 1.0
        if not _is_scalar(raw_weight):
            raise fail("weight", f"must be a number, got {_describe(raw_weight)}")
        weight = _float_scalar(raw_weight, lambda reason: fail("weight", reason))
        if weight < 0:
            raise fail("weight", f"must be >= 0, got {weight}")
        return weight

    def _routes(self, raw: Any, n: int, row: int, fail) -> Optional[np.ndarray]:
        """int16 ``[n, L, k]`` routes of a sample (a missing final route as a row of -1), or None."""
        def bad(reason: str) -> SampleValidationError:
            return fail("routed_experts", reason)

        present = raw is not None
        if self._routes_present is None:
            self._routes_present = present
        elif present != self._routes_present:
            state = "carries them" if self._routes_present else "has none"
            raise bad(f"{'missing' if not present else 'given'}, but the first sample ({self.row_label} "
                      f"{self.rows[0]}) {state}; either every sample carries routes or none does")
        if not present:
            return None
        shape = self.routing
        if shape is not None and not shape.is_moe:
            raise bad(f"routes given, but the {shape.model} has no mixture-of-experts layer to replay them in")
        routes = _routes_array(raw, bad)
        m, layers, topk = routes.shape
        if m not in (n, n - 1):
            raise bad(f"{m} routes for len(tokens) {n} tokens; expected one per token (or one less: "
                      "no route for the final token)")
        if shape is not None:
            expected, what = (shape.num_layers, shape.topk), f"the {shape.model}'s"
        elif self._routes_shape is not None:
            expected, what = self._routes_shape, f"the first sample's ({self.row_label} {self.rows[0]})"
        else:
            expected, what = (layers, topk), ""
        if (layers, topk) != expected:
            raise bad(f"shape [{m}, {layers}, {topk}] (tokens x MoE layers x top-k), but {what} routes are "
                      f"[tokens, {expected[0]}, {expected[1]}]")
        if topk < 1 or layers < 1:
            raise bad(f"shape [{m}, {layers}, {topk}] (tokens x MoE layers x top-k) has no expert ids")
        self._routes_shape = (layers, topk)
        limit = shape.num_experts if shape is not None else MAX_EXPERT_ID + 1
        outside = (routes < 0) | (routes >= limit)
        if outside.any():
            t, layer, j = (int(x) for x in np.argwhere(outside)[0])
            bound = f"num_experts {limit}" if shape is not None else "int16"
            raise bad(f"expert id {int(routes[t, layer, j])} at token {t}, layer {layer} is outside "
                      f"[0, {limit}) ({bound})")
        if topk > 1:
            ordered = np.sort(routes, axis=2)
            dup = (ordered[:, :, 1:] == ordered[:, :, :-1]).any(axis=2)  # [m, L]
            if dup.any():
                t, layer = (int(x) for x in np.argwhere(dup)[0])
                raise bad(f"duplicate expert id in the top-k {routes[t, layer].tolist()} of token {t}, layer {layer}")
        routes = routes.astype(np.int16)
        if m == n - 1:  # the final token's route: none (no log-prob depends on it)
            routes = np.concatenate([routes, np.full((1, layers, topk), -1, dtype=np.int16)])
        return routes

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
            routed_experts=self.routed_experts.result() if self._routes_present else None,
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


def _routes_array(value: Any, fail) -> np.ndarray:
    """An int64 ``[m, L, k]`` array from a nested list (tokens x layers x top-k) of integers or
    an integer numpy array; naming the token (and layer) of the first malformed entry."""
    if isinstance(value, np.ndarray) and value.dtype == object:
        value = value.tolist()  # e.g. a Parquet cell of nested lists
    if isinstance(value, np.ndarray):
        if value.ndim != 3:
            raise fail(f"must be a [tokens][MoE layers][top-k] nested list of expert ids, got an array of shape "
                       f"{value.shape}")
        if value.dtype.kind not in "iu":
            raise fail(f"must hold integer expert ids, got an array of dtype {value.dtype}")
        return value.astype(np.int64, copy=False)
    if not isinstance(value, (list, tuple)) or not value:
        raise fail(f"must be a [tokens][MoE layers][top-k] nested list of expert ids, got {_describe(value)}")
    try:
        array = np.array(value)
        ok = array.ndim == 3 and array.dtype.kind in "iu"
    except (ValueError, OverflowError):  # ragged lists, or ids beyond int64
        ok = False
    # numpy turns booleans into ints: the element types (iterated at C speed) tell them apart
    if ok and array.dtype.kind == "i" and _types_ok(set(map(type, chain.from_iterable(chain.from_iterable(value)))),
                                                    _INT_TYPES):
        return array.astype(np.int64, copy=False)
    # The error path: find the first malformed token / layer / element.
    layers = topk = None
    for t, token in enumerate(value):
        if not isinstance(token, (list, tuple, np.ndarray)):
            raise fail(f"token {t}: expected a list of MoE layers, got {_describe(token)}")
        if layers is not None and len(token) != layers:
            raise fail(f"token {t} has routes for {len(token)} MoE layers, token 0 for {layers}")
        layers = len(token)
        for layer, ids in enumerate(token):
            if not isinstance(ids, (list, tuple, np.ndarray)):
                raise fail(f"token {t}, layer {layer}: expected a list of expert ids, got {_describe(ids)}")
            if topk is not None and len(ids) != topk:
                raise fail(f"token {t}, layer {layer} has {len(ids)} expert ids, token 0 layer 0 has {topk}")
            topk = len(ids)
            for x in ids:
                if not _is_int(x):
                    raise fail(f"token {t}, layer {layer}: element {_describe(x)}; expert ids must be integers")
                if not -(2**63) <= x < 2**63:
                    raise fail(f"expert id {x} at token {t}, layer {layer} is out of range")
    raise fail("must be a [tokens][MoE layers][top-k] nested list of expert ids, with at least one id")


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


def check_routed_experts(batch: SampleBatch, routing: RoutingShape) -> None:
    """Refuse a batch's ``routed_experts`` that do not fit the model (``routing``): routes for a
    dense model, another number of MoE layers or experts per token, an expert id outside
    ``[0, E)``. For batches built without the model's shape (records are checked as they are
    read, :class:`SampleAccumulator`); names the sample, token and layer."""
    routes = batch.routed_experts
    if routes is None:
        return

    def fail(s: int, reason: str) -> SampleValidationError:
        return SampleValidationError(reason, source=batch.source, row_label=batch.row_label,
                                     row=int(batch.source_rows[s]), sample_id=batch.ids[s], has_sample_id=True,
                                     field="routed_experts")

    if not routing.is_moe:
        raise fail(0, f"routes given, but the {routing.model} has no mixture-of-experts layer to replay them in")
    _, layers, topk = routes.shape
    if (layers, topk) != (routing.num_layers, routing.topk):
        raise fail(0, f"routes are [tokens, {layers}, {topk}] (tokens x MoE layers x top-k), but the "
                      f"{routing.model}'s are [tokens, {routing.num_layers}, {routing.topk}]")
    missing = (routes < 0).all(axis=(1, 2))  # a final token without a route
    bad = ((routes < 0) | (routes >= routing.num_experts)).any(axis=2) & ~missing[:, None]  # [N, L]
    if bad.any():
        flat, layer = (int(x) for x in np.argwhere(bad)[0])
        s = int(np.searchsorted(batch.offsets, flat, side="right")) - 1
        ids = routes[flat, layer].tolist()
        raise fail(s, f"expert ids {ids} at token {flat - int(batch.offsets[s])}, layer {layer}: outside "
                      f"[0, {routing.num_experts}) (num_experts {routing.num_experts})")
