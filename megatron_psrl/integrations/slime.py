"""slime's train data <-> this project's samples.

slime (THUDM/slime) hands its Megatron actor a dict of per-sample lists (``rollout_data``):

- ``tokens``: prompt + response token ids;
- ``response_lengths``: tokens of the response (the last ones of ``tokens``);
- ``loss_masks``: one 0/1 per response token (0 on tool output and other tokens not trained);
- ``rewards`` (scalar per sample, group-normalised by slime for GRPO), ``raw_reward``,
  ``truncated``, ``sample_indices``;
- per response token, when present: ``advantages`` (after slime's
  ``compute_advantages_and_returns``), ``log_probs`` (the old policy, recomputed by the
  trainer), ``rollout_log_probs`` (the inference engine's), ``ref_log_probs``;
- others (``rollout_routed_experts``, ``teacher_log_probs``, multimodal inputs) are not used here.

:func:`samples_from_slime` turns it into the sample dicts of docs/data-format.md (log-probs and
advantages aligned with the whole sequence, zero over the prompt), which ``PolicyActor``
shares prefixes over: GRPO groups share their prompt, multi-turn histories their turns.
:func:`logprobs_to_slime` turns the actor's per-sample log-probs back into slime's
response-aligned tensors. No slime installation is needed.
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Sequence

import numpy as np
import torch

from megatron_psrl.data.validation import SampleValidationError

OLD_LOGPROB_KEYS = ("log_probs", "rollout_log_probs")
"""Where the old policy's log-probs come from, in order of preference: the trainer's
recomputation (slime's default), else the inference engine's (``--use-rollout-logprobs``)."""


_PER_SAMPLE_KEYS = ("tokens", "response_lengths", "loss_masks", "rewards", "raw_reward", "truncated",
                    "sample_indices", "advantages", "log_probs", "rollout_log_probs", "ref_log_probs")
"""slime's keys with one entry per sample (their lengths must agree)."""


class _Where:
    """Names a sample (its position in the lists and its slime sample index) in errors."""

    def __init__(self, source: str, i: Optional[int] = None, sample_id: Any = None):
        self.source, self.i, self.sample_id = source, i, sample_id

    def error(self, reason: str, field: Optional[str] = None) -> SampleValidationError:
        return SampleValidationError(reason, source=self.source, row_label=None if self.i is None else "sample",
                                     row=self.i, sample_id=self.sample_id, has_sample_id=self.i is not None,
                                     field=field)


def _flat(value: Any, where: _Where, field: str, dtype) -> np.ndarray:
    """A 1-D numpy array of a list, numpy array or tensor (on any device)."""
    if isinstance(value, torch.Tensor):
        value = value.detach().to("cpu")
        value = value.float().numpy() if value.is_floating_point() else value.numpy()
    try:
        array = np.asarray(value)
    except (TypeError, ValueError) as exc:
        raise where.error(f"not a list of numbers ({exc})", field) from None
    if array.ndim != 1:
        raise where.error(f"expected a 1-D list, got shape {array.shape}", field)
    return array.astype(dtype, copy=False)


def samples_from_slime(rollout_data: Mapping[str, Sequence[Any]], *, old_logprobs: Optional[str] = "auto",
                       source: str = "<slime rollout_data>") -> List[Dict[str, Any]]:
    """Sample dicts (docs/data-format.md) from slime's ``rollout_data``.

    ``old_logprobs``: the key whose per-response-token log-probs become ``old_logprobs``
    (``auto``: the first of :data:`OLD_LOGPROB_KEYS` present; None: none, ratio 1). The
    advantage is the per-token ``advantages`` when present, else the sample's ``rewards``
    (GRPO's group-normalised reward, broadcast). Errors name the sample and the field."""
    whole = _Where(source)
    n = len(rollout_data.get("tokens", ()))
    for key in ("tokens", "response_lengths", "loss_masks"):
        if key not in rollout_data:
            raise whole.error("missing (slime's train data has it)", key)
    for key, values in rollout_data.items():
        if key in _PER_SAMPLE_KEYS and len(values) != n:
            raise whole.error(f"{len(values)} entries, 'tokens' has {n}", key)
    if "advantages" not in rollout_data and "rewards" not in rollout_data:
        raise whole.error("neither 'advantages' nor 'rewards' is present: no advantage to train with")
    if old_logprobs == "auto":
        old_logprobs = next((k for k in OLD_LOGPROB_KEYS if k in rollout_data), None)
    elif old_logprobs is not None and old_logprobs not in rollout_data:
        raise whole.error("missing (the old log-probs asked for)", old_logprobs)
    ids = rollout_data.get("sample_indices")
    samples = []
    for i in range(n):
        sample_id = int(ids[i]) if ids is not None else i
        where = _Where(source, i, sample_id)
        tokens = _flat(rollout_data["tokens"][i], where, "tokens", np.int64)
        length = len(tokens)
        response = int(rollout_data["response_lengths"][i])
        if not 1 <= response < length:
            raise where.error(f"{response} must be at least 1 and shorter than the {length} tokens (the prompt has "
                              "at least one token)", "response_lengths")
        prompt = length - response

        def per_response_token(key: str, dtype) -> np.ndarray:
            values = _flat(rollout_data[key][i], where, key, dtype)
            if len(values) != response:
                raise where.error(f"length {len(values)} != response length {response}", key)
            return np.concatenate([np.zeros(prompt, dtype), values])

        sample: Dict[str, Any] = {"id": sample_id, "tokens": tokens.tolist(),
                                  "loss_mask": per_response_token("loss_masks", np.int64).tolist()}
        if "advantages" in rollout_data:
            sample["advantage"] = per_response_token("advantages", np.float32).tolist()
        else:
            sample["advantage"] = float(_flat([rollout_data["rewards"][i]], where, "rewards", np.float64)[0])
        if old_logprobs is not None:
            sample["old_logprobs"] = per_response_token(old_logprobs, np.float32).tolist()
        if "ref_log_probs" in rollout_data:
            sample["ref_logprobs"] = per_response_token("ref_log_probs", np.float32).tolist()
        samples.append(sample)
    return samples


def logprobs_to_slime(logprobs: Sequence[np.ndarray], response_lengths: Sequence[int]) -> List[torch.Tensor]:
    """The actor's per-sample log-probs (``lp[t] = log p(tokens[t] | tokens[:t])``, whole
    sequence) as slime's: one float32 tensor per sample over its response tokens."""
    if len(logprobs) != len(response_lengths):
        raise ValueError(f"{len(logprobs)} log-prob arrays for {len(response_lengths)} response lengths")
    out = []
    for i, (lp, response) in enumerate(zip(logprobs, response_lengths)):
        response = int(response)
        if not 1 <= response < len(lp):
            raise ValueError(f"sample {i}: response length {response} does not fit its {len(lp)} log-probs")
        out.append(torch.from_numpy(np.asarray(lp[len(lp) - response:], dtype=np.float32).copy()))
    return out


__all__ = ["OLD_LOGPROB_KEYS", "logprobs_to_slime", "samples_from_slime"]
