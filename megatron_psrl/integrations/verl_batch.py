"""verl's no-padding batches as the project's columnar ``SampleBatch``, and back.

Everything here works on flat arrays with offsets: verl's jagged ``input_ids`` become one token
array over the mini-batch, data-parallel ranks exchange their shares as tensors (their lengths
first, then padded flat values), and per-token outputs go back to verl's layout by one shift
over the flat array. No Python object per token is made, so the hand-off stays a small part of
a call even for millions of tokens (docs/integrations.md has the measurement).

Two layouts meet. The project's per-token arrays hold at index ``t`` of a sample what concerns
token ``t`` given ``tokens[:t]`` (its log-prob; 0 at ``t = 0``); verl's outputs hold at ``t``
the log-prob of token ``t + 1`` (0 at the last position).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from megatron_psrl.data.samples import SampleBatch
from megatron_psrl.errors import ConfigurationError


@dataclass
class VerlSequences:
    """One data-parallel rank's share of a verl mini-batch, as flat token ids."""

    tokens: np.ndarray
    """int64 ``[n]``: prompt + response token ids of every sample (padding removed), concatenated."""

    prompt_lengths: np.ndarray
    """int64 ``[B]``: tokens of every sample's prompt (>= 1)."""

    offsets: torch.Tensor
    """int64 ``[B + 1]``: the jagged offsets of verl's ``input_ids`` (the layout of its outputs)."""

    @property
    def num_samples(self) -> int:
        return len(self.prompt_lengths)

    @property
    def starts(self) -> np.ndarray:
        """int64 ``[B + 1]``: ``offsets`` as a numpy array."""
        return self.offsets.numpy()

    def response_index(self) -> np.ndarray:
        """int64 ``[sum of response lengths]``: the flat index of every response token, sample
        after sample (the order of verl's response-shaped tensors' valid entries)."""
        starts = self.starts
        lengths = np.diff(starts) - self.prompt_lengths
        before = np.zeros(len(lengths), dtype=np.int64)  # response tokens of the samples before
        np.cumsum(lengths[:-1], out=before[1:])
        return np.repeat(starts[:-1] + self.prompt_lengths - before, lengths) + np.arange(int(lengths.sum()))

    def per_token(self, values: torch.Tensor, index: Optional[np.ndarray] = None, dtype=np.float32) -> np.ndarray:
        """A verl response-shaped tensor (padded ``[B, R]`` or jagged ``[B, r_i]``) as a per-token
        array over this share's tokens, 0 outside the responses (``index``: :meth:`response_index`)."""
        index = self.response_index() if index is None else index
        lengths = np.diff(self.starts) - self.prompt_lengths
        if getattr(values, "is_nested", False):
            valid = values.values().detach().to("cpu").numpy()
        else:
            padded = values.detach().to("cpu").numpy()
            width = padded.shape[1]
            if width < lengths.max(initial=0):
                raise ConfigurationError(f"verl batch: a response-shaped tensor of width {width} for responses of up "
                                         f"to {int(lengths.max())} tokens")
            valid = padded[np.arange(width)[None, :] < lengths[:, None]]  # (numpy: torch's mask indexing is slower)
        out = np.zeros(len(self.tokens), dtype=dtype)
        out[index] = valid
        return out


def response_mask(offsets: np.ndarray, prompt_lengths: np.ndarray) -> np.ndarray:
    """bool ``[offsets[-1]]``: the response tokens of samples delimited by ``offsets`` (one pass
    over the tokens: +1 where a response starts, -1 where it ends, summed)."""
    steps = np.zeros(int(offsets[-1]) + 1, dtype=np.int8)
    np.add.at(steps, offsets[:-1] + prompt_lengths, 1)
    np.add.at(steps, offsets[1:], -1)
    return np.cumsum(steps[:-1], dtype=np.int8) > 0


def sequences_of(data) -> VerlSequences:
    """The token sequences of a verl batch in the no-padding layout (``left_right_2_no_padding``:
    jagged ``input_ids``; prompt lengths from ``prompts`` / ``attention_mask``, as verl's
    ``no_padding_2_padding`` reads them). Positions must be 0, 1, 2, ... per sample (text
    models; 3-D rope positions of vision-language models are refused)."""
    input_ids = data["input_ids"]
    if not getattr(input_ids, "is_nested", False):
        raise ConfigurationError("the psrl engine takes verl's no-padding layout (jagged input_ids from "
                                 "left_right_2_no_padding), got a padded input_ids")
    offsets = input_ids.offsets().to("cpu", torch.int64)
    tokens = input_ids.values().to("cpu", torch.int64).numpy()
    lengths = offsets.diff().numpy()
    prompts = data["prompts"]
    if getattr(prompts, "is_nested", False):
        prompt_lengths = prompts.offsets().diff().to("cpu").numpy()
    else:
        prompt_lengths = data["attention_mask"][:, : prompts.shape[1]].sum(dim=1).to("cpu").numpy()
    prompt_lengths = prompt_lengths.astype(np.int64)
    bad = np.flatnonzero((prompt_lengths < 1) | (prompt_lengths >= lengths))
    if len(bad):
        i = int(bad[0])
        raise ConfigurationError(f"verl batch, sample {i}: prompt of {prompt_lengths[i]} tokens in a sequence of "
                                 f"{lengths[i]} (needs at least one prompt and one response token)")
    if "position_ids" in data.keys():
        positions = data["position_ids"]
        if positions.is_nested and positions.values().dim() == 1:
            values = positions.values().to("cpu", torch.int64).numpy()
            steps = np.diff(values)  # 1 within a sample; the step into the next sample must start at 0
            steps[offsets[1:-1].numpy() - 1] = 1
            if len(values) and not (np.all(values[offsets[:-1].numpy()] == 0) and np.all(steps == 1)):
                raise ConfigurationError("verl batch: position_ids are not 0, 1, 2, ... per sample; the psrl engine "
                                         "derives positions from each sample's tokens (text models)")
        elif positions.is_nested:
            raise ConfigurationError("verl batch: multi-dimensional position_ids (vision-language rope) are not "
                                     "supported by the psrl engine")
    return VerlSequences(tokens=tokens, prompt_lengths=prompt_lengths, offsets=offsets)


# ---------------------------------------------------------------------- across ranks
def gather_flat(values: np.ndarray, group, size: int, device) -> np.ndarray:
    """Every data-parallel rank's 1-D ``values`` concatenated in rank order (lengths first, then
    the values padded to the longest; ``group`` None: ``values`` itself)."""
    if group is None:
        return values
    local = torch.from_numpy(np.ascontiguousarray(values)).to(device)
    count = torch.tensor([local.numel()], dtype=torch.int64, device=device)
    counts = [torch.zeros_like(count) for _ in range(size)]
    dist.all_gather(counts, count, group=group)
    counts = [int(c.item()) for c in counts]
    padded = torch.zeros(max(counts), dtype=local.dtype, device=device)
    padded[:local.numel()] = local
    parts = [torch.empty_like(padded) for _ in range(size)]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([p[:n] for p, n in zip(parts, counts)]).to("cpu").numpy()


@dataclass
class GatheredSequences:
    """The whole mini-batch (every data-parallel rank's share, in rank order), columnar."""

    tokens: np.ndarray
    """int32 ``[N]``: token ids of all samples, concatenated."""

    offsets: np.ndarray
    """int64 ``[S + 1]``: start of every sample."""

    prompt_lengths: np.ndarray
    """int64 ``[S]``."""

    samples_per_rank: np.ndarray
    """int64 ``[dp]``: samples of each data-parallel rank's share."""

    rank: int
    """This rank's index among them."""

    @property
    def num_samples(self) -> int:
        return len(self.prompt_lengths)

    @property
    def mine(self) -> slice:
        """This rank's samples."""
        first = int(self.samples_per_rank[:self.rank].sum())
        return slice(first, first + int(self.samples_per_rank[self.rank]))

    @property
    def my_tokens(self) -> slice:
        """This rank's tokens in the flat arrays."""
        mine = self.mine
        return slice(int(self.offsets[mine.start]), int(self.offsets[mine.stop]))

    def sample_rank(self) -> np.ndarray:
        """int64 ``[S]``: the data-parallel rank that holds each sample."""
        return np.repeat(np.arange(len(self.samples_per_rank), dtype=np.int64), self.samples_per_rank)

    def batch(self, loss_mask: np.ndarray, vocab_size: int, **columns) -> SampleBatch:
        """A ``SampleBatch`` of the mini-batch with this ``loss_mask`` (bool ``[N]``) and per-token
        ``columns`` (``advantages``, ``old_logprobs``, ``ref_logprobs``: with their flags, all set)."""
        if len(self.tokens) and (self.tokens.min() < 0 or self.tokens.max() >= vocab_size):
            raise ConfigurationError(f"verl batch: token ids outside the model's vocabulary [0, {vocab_size})")
        flags = {f"has_{k}": np.ones(self.num_samples, dtype=bool) for k in ("old_logprobs", "ref_logprobs")
                 if columns.get(k) is not None}
        return SampleBatch(ids=list(range(self.num_samples)), offsets=self.offsets, tokens=self.tokens,
                           loss_mask=loss_mask, source="<verl batch>", **columns, **flags)

    def response_mask(self) -> np.ndarray:
        """bool ``[N]``: every response token (the prompt's are False)."""
        return response_mask(self.offsets, self.prompt_lengths)


def gather_sequences(seqs: VerlSequences, group, size: int, rank: int, device) -> GatheredSequences:
    """Every data-parallel rank's token sequences, as tensors over ``group`` (None: this rank's)."""
    lengths = np.diff(seqs.starts)
    counts = gather_flat(np.array([seqs.num_samples], dtype=np.int64), group, size, device)
    all_lengths = gather_flat(lengths, group, size, device)
    offsets = np.zeros(len(all_lengths) + 1, dtype=np.int64)
    np.cumsum(all_lengths, out=offsets[1:])
    return GatheredSequences(tokens=gather_flat(seqs.tokens, group, size, device).astype(np.int32),
                             offsets=offsets, prompt_lengths=gather_flat(seqs.prompt_lengths, group, size, device),
                             samples_per_rank=counts, rank=rank if group is not None else 0)


# ---------------------------------------------------------------------- layouts
def to_verl(per_token: np.ndarray, offsets: np.ndarray) -> torch.Tensor:
    """float32 ``[n]``: the project's per-token values in verl's layout, ``y[t] = x[t + 1]`` within
    each sample, 0 at its last position."""
    y = np.zeros(len(per_token), dtype=np.float32)
    y[:-1] = per_token[1:]
    y[offsets[1:] - 1] = 0.0
    return torch.from_numpy(y)


def from_verl(values: torch.Tensor, offsets: np.ndarray) -> np.ndarray:
    """Inverse of :func:`to_verl` on a flat ``[n]`` tensor: ``x[t] = y[t - 1]``, 0 at position 0."""
    y = values.detach().to("cpu", torch.float32).numpy()
    x = np.zeros(len(y), dtype=np.float32)
    x[1:] = y[:-1]
    x[offsets[:-1]] = 0.0
    return x


__all__ = ["GatheredSequences", "VerlSequences", "from_verl", "gather_flat", "gather_sequences", "sequences_of",
           "to_verl"]
