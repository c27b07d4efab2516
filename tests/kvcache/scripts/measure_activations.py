"""Measure what one forward pass keeps alive for backward, in a process of its own; prints JSON.

For one tiny config, in both sharing modes (independent causal sequences, and a tree pack
where four responses share one prompt) and both dtypes:

- ``saved``: bytes per token of the storages autograd saves (``saved_tensors_hooks``, the
  model's parameters excluded): a count, the same on every machine;
- ``held``: bytes per token the C heap holds after the forward pass (fp32 only), measured
  after a warm-up forward of the same size, so that the BLAS library's buffer pool (MKL keeps
  per-thread packing buffers for the life of the process, sized by the largest GEMM seen) is
  already there and not counted as the graph's; ``pool``: what that warm-up added, reported.

Run in a fresh process because the heap figure is process-wide: anything another test left
behind in the process (or freed during the measurement) would move it.
"""

import gc
import json
import sys
import weakref

import torch

from megatron_psrl.attention import TreeAttentionMetadata, causal_plan, tree_plan
from megatron_psrl.checkpoint import ModelSource, load_model
from megatron_psrl.distributed.setup import initialize_parallel
from megatron_psrl.engine.memory import heap_bytes_in_use

PROMPT, RESPONSES, RESPONSE = 512, 4, 128
N = PROMPT + RESPONSES * RESPONSE  # 1,024 tokens in both modes


def _metadata(mode: str):
    if mode == "no-sharing":
        return torch.arange(N), TreeAttentionMetadata(plan=causal_plan([N]))
    starts = [0] + [PROMPT + j * RESPONSE for j in range(RESPONSES)]
    ends = starts[1:] + [N]
    plan = tree_plan(starts, ends, [-1] + [0] * RESPONSES)
    positions = torch.cat([torch.arange(PROMPT)] + [torch.arange(PROMPT, PROMPT + RESPONSE)] * RESPONSES)
    return positions, TreeAttentionMetadata(plan=plan)


def _saved_bytes(model, ids, positions, metadata) -> int:
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}  # storage address -> (bytes, a saved tensor of it)

    def pack(t):
        storage = t.untyped_storage()
        held = seen.get(storage.data_ptr())
        if storage.data_ptr() not in params and (held is None or held[1]() is None):
            seen[storage.data_ptr()] = (storage.nbytes(), weakref.ref(t))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        hidden = model(ids, positions, metadata)
    # what the graph holds: a tensor saved by a node that the forward dropped again (a discarded
    # branch, e.g. the sigmoid router's selection on biased scores) is freed, and its address
    # may be another storage's since
    total = sum(nbytes for nbytes, ref in seen.values() if ref() is not None)
    del hidden
    return total


def _held_bytes(model, ids, positions, metadata) -> int:
    gc.collect()
    before = heap_bytes_in_use()
    hidden = model(ids, positions, metadata)
    held = heap_bytes_in_use() - before
    del hidden
    return held


def main(name: str) -> None:
    initialize_parallel(1, 1, seed=0, device="cpu")
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        arch, model, _ = load_model(ModelSource(tiny=name), dtype=dtype)
        ids = torch.randint(0, arch.vocab_size, (N,))
        for mode in ("no-sharing", "sharing"):
            positions, metadata = _metadata(mode)
            row = {}
            if dtype == torch.float32:
                cold = _held_bytes(model, ids, positions, metadata)
                row["held"] = _held_bytes(model, ids, positions, metadata) / N
                row["pool"] = cold - row["held"] * N
            row["saved"] = _saved_bytes(model, ids, positions, metadata) / N
            out[f"{mode}/{str(dtype).split('.')[-1]}"] = row
        del model
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])
