"""Measure what one forward pass of an MoE model keeps alive for backward, in a process of its
own; prints JSON (the MoE counterpart of ``measure_activations.py``, whose inputs it reuses).

For one MoE config and one token dispatcher, in both sharing modes and both dtypes:

- ``saved``: bytes per token of the storages autograd saves (``saved_tensors_hooks``, the
  parameters excluded): a count, the same on every machine;
- ``held``: bytes per token the C heap holds for one more kept graph (fp32 only). megatron's
  token dispatchers keep the last forward's routing tensors as attributes (``local_probs``,
  ``routing_map``, ...), which keep that forward's autograd graph alive until the next forward
  through the layer; so a graph is measured while another one is kept (as the step runner
  keeps producers' graphs), after a warm-up that fills the BLAS library's buffer pool.
"""

import gc
import json
import sys

import torch
from measure_activations import N, _metadata, _saved_bytes

from megatron_psrl.checkpoint import ModelSource, load_model
from megatron_psrl.distributed.setup import initialize_parallel
from megatron_psrl.engine.memory import heap_bytes_in_use
from megatron_psrl.model.moe import install_moe_runtime


def _held_bytes(model, ids, positions, metadata) -> int:
    warm = model(ids, positions, metadata)  # BLAS pool; its graph stays referenced by the dispatchers
    del warm
    kept = model(ids, positions, metadata)  # the warm-up's graph goes; this one is kept
    gc.collect()
    before = heap_bytes_in_use()
    hidden = model(ids, positions, metadata)
    held = heap_bytes_in_use() - before
    del hidden, kept
    return held


def main(name: str, dispatcher: str) -> None:
    initialize_parallel(1, 1, seed=0, device="cpu")
    install_moe_runtime(torch.device("cpu"))
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        arch, model, _ = load_model(ModelSource(tiny=name), dtype=dtype,
                                    config_overrides={"moe_token_dispatcher_type": dispatcher})
        ids = torch.randint(0, arch.vocab_size, (N,))
        for mode in ("no-sharing", "sharing"):
            positions, metadata = _metadata(mode)
            row = {}
            if dtype == torch.float32:
                row["held"] = _held_bytes(model, ids, positions, metadata) / N
            row["saved"] = _saved_bytes(model, ids, positions, metadata) / N
            out[f"{mode}/{str(dtype).split('.')[-1]}"] = row
        del model
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
