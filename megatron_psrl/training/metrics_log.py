"""Metrics to TensorBoard and Weights & Biases, as Megatron-LM logs them.

Every numeric field of an iteration's ``--log-json`` record (loss terms, tokens, KV cache and
planner metrics, phase times) becomes a scalar at that iteration: ``--tensorboard-dir`` writes
TensorBoard event files (the ``tensorboard`` package), ``--wandb-project`` /
``--wandb-exp-name`` a W&B run (the optional ``wandb`` package; offline unless
``WANDB_API_KEY`` or ``WANDB_MODE`` says otherwise, so it works without a network; files under
``--wandb-save-dir``, default ``<--save>/wandb``). Only the logging rank writes.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Dict, List, Mapping, Optional, Sequence

from megatron_psrl.errors import MissingRequirementError


class MetricsLog:
    """TensorBoard and/or W&B sinks for iteration records (no-ops when not configured)."""

    def __init__(self, tensorboard_dir: Optional[str] = None, wandb_project: Optional[str] = None,
                 wandb_exp_name: Optional[str] = None, config: Optional[Mapping[str, Any]] = None,
                 enabled: bool = True, wandb_dir: Optional[str] = None):
        self.tensorboard = None
        self.wandb = None
        if not enabled:
            return
        if tensorboard_dir:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as exc:
                raise MissingRequirementError("--tensorboard-dir needs the tensorboard package: pip install "
                                              "tensorboard") from exc
            self.tensorboard = SummaryWriter(log_dir=tensorboard_dir)
        if wandb_project:
            try:
                import wandb
            except ImportError as exc:
                raise MissingRequirementError("--wandb-project needs the wandb package: pip install wandb") from exc
            mode = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
            if wandb_dir:
                os.makedirs(wandb_dir, exist_ok=True)
            self.wandb = wandb.init(project=wandb_project, name=wandb_exp_name, mode=mode, dir=wandb_dir,
                                    config={k: v for k, v in (config or {}).items() if _plain(v)})

    def scalars(self, values: Mapping[str, Any], step: int) -> None:
        numeric = {k: float(v) for k, v in values.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
                   and math.isfinite(float(v))}
        if self.tensorboard is not None:
            for key, value in numeric.items():
                self.tensorboard.add_scalar(key, value, step)
            self.tensorboard.flush()
        if self.wandb is not None:
            self.wandb.log(numeric, step=step)

    def record(self, rec) -> None:
        """An ``IterationRecord``: every numeric field, at its iteration (an MoE model's
        ``moe_expert_load`` as each layer's max / mean tokens per expert)."""
        values: Dict[str, Any] = dataclasses.asdict(rec)
        values.update(values.pop("extra"))
        values["skipped"] = int(bool(values.get("skipped")))
        for layer, ratio in enumerate(expert_load_ratios(values.get("moe_expert_load") or [])):
            values[f"moe_expert_load_max_over_mean/layer{layer}"] = ratio
        for key, value in (values.get("sharing_check") or {}).items():  # (a checked step's comparison)
            if key != "samples":
                values[f"sharing_check/{key}"] = float(value)
        self.scalars(values, int(rec.iter))

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
            self.tensorboard = None
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None


def expert_load_ratios(load: Sequence[Sequence[float]]) -> List[float]:
    """Each MoE layer's busiest expert's tokens over the mean per expert (1.0: perfectly even),
    from ``moe_expert_load``'s ``[max, mean]`` pairs; a layer that routed nothing: 0."""
    return [float(m) / float(a) if a else 0.0 for m, a in load]


def _plain(value: Any) -> bool:
    return isinstance(value, (int, float, str, bool)) or value is None
