#!/usr/bin/env python
"""Weights to the rollout engine: the psrl engine's ``get_per_tensor_param`` (verl's call; Hugging
Face-named tensors streamed a bucket at a time) against a plain ``state_dict()`` copy, for a
1.5B-class model (Qwen2.5-1.5B's dimensions, random weights) on CPU.

    python benchmarks/bench_weight_stream.py [--dtype bfloat16] [--bucket-mb 256] [--repeats 3]
    python benchmarks/bench_weight_stream.py --quick     # a tiny Qwen2 (seconds)

Measured per way of getting the weights, with the consumer dropping each tensor as it arrives
(what a rollout engine's ``update_weights`` does once it has loaded it):

- ``get_per_tensor_param``: the engine's stream (``PsrlEngine.get_per_tensor_param``), buckets
  of ``--bucket-mb`` of full tensors, Hugging Face names and layouts;
- ``state_dict_hf()``: the same tensors collected into one dict first (the whole model at once);
- ``state_dict() copy``: megatron's own ``state_dict()`` of the model, every tensor copied (what
  an engine that hands over "a copy of its weights" holds), megatron's names and layouts.

Time: median of ``--repeats``. Memory: the peak heap above the start of the call, sampled
(``PeakMemory``, ``sampled``): what the hand-over costs on top of the model itself.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("VERL_USE_EXTERNAL_MODULES",
                      "megatron_psrl.integrations.verl_cpu_platform,megatron_psrl.integrations.verl")

import torch  # noqa: E402

QWEN25_1_5B = dict(model_type="qwen2", hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                   num_attention_heads=12, num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768,
                   rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)
"""Qwen2.5-1.5B's dimensions (its config.json): 1.54B parameters."""

TINY_QWEN2 = dict(QWEN25_1_5B, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=256)


def hf_checkpoint(config: dict, dtype: torch.dtype) -> str:
    """A Hugging Face folder of ``config`` with random weights (initialised in ``dtype``)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_dir = tempfile.mkdtemp(prefix="bench-weights-")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config), torch_dtype=dtype)
    model.save_pretrained(hf_dir)
    del model
    return hf_dir


def engine_of(hf_dir: str, dtype: str):
    """The psrl engine as verl builds it (forward-only: no optimizer state to hold)."""
    from verl.workers.config import HFModelConfig
    from verl.workers.engine import EngineRegistry

    from megatron_psrl.integrations.verl import BACKEND, PsrlEngineConfig

    engine = EngineRegistry.new("language_model", backend=BACKEND,
                                model_config=HFModelConfig(path=hf_dir, load_tokenizer=False),
                                engine_config=PsrlEngineConfig(dtype=dtype, device="cpu", forward_only=True),
                                optimizer_config=None, checkpoint_config=None)
    engine.initialize()
    return engine


def consume(pairs) -> tuple:
    """Take every ``(name, tensor)`` and drop it (a rollout engine loads, then frees)."""
    count, size = 0, 0
    for _, tensor in pairs:
        count += 1
        size += tensor.numel() * tensor.element_size()
    return count, size


def ways(engine, bucket_bytes: int) -> dict:
    actor = engine.actor

    def stream():
        return consume(actor.iter_hf_weights(bucket_bytes=bucket_bytes))

    def verl_call():  # what verl's rollout sync calls (the default bucket)
        return consume(engine.get_per_tensor_param()[0])

    def whole_dict():
        weights = actor.state_dict_hf()
        return consume(weights.items())

    def plain_copy():
        weights = {}
        for _, chunk in actor.engine.stage_chunks():
            for name, tensor in chunk.state_dict().items():
                if isinstance(tensor, torch.Tensor):
                    weights[name] = tensor.detach().clone()
        return consume(weights.items())

    return {f"iter_hf_weights ({bucket_bytes >> 20} MB buckets)": stream, "get_per_tensor_param": verl_call,
            "state_dict_hf()": whole_dict, "state_dict() copy": plain_copy}


def measure(fn, repeats: int) -> dict:
    from megatron_psrl.engine.memory import PeakMemory

    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        count, size = fn()
        times.append(time.perf_counter() - start)
    with PeakMemory(torch.device("cpu"), mode="sampled") as mem:
        fn()
    return dict(seconds=statistics.median(times), tensors=count, gb=size / 1e9,
                peak_above_start_mb=(mem.peak_bytes - mem.start_bytes) / 2**20)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--bucket-mb", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="a tiny Qwen2 instead of 1.5B (for tests)")
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    args = parser.parse_args(argv)
    config = TINY_QWEN2 if args.quick else QWEN25_1_5B
    dtype = getattr(torch, args.dtype)
    start = time.perf_counter()
    hf_dir = hf_checkpoint(config, dtype)
    engine = engine_of(hf_dir, args.dtype)
    params = sum(p.numel() for _, chunk in engine.engine.stage_chunks() for p in chunk.parameters())
    print(f"model: {'tiny qwen2' if args.quick else 'Qwen2.5-1.5B dims'}, {params / 1e9:.2f}B parameters, "
          f"{args.dtype}, built in {time.perf_counter() - start:.0f} s")
    rows = []
    for name, fn in ways(engine, args.bucket_mb << 20).items():
        rows.append(dict(way=name, **measure(fn, args.repeats)))
    print("| weights by | tensors | GB | s (median) | peak above start MB |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['way']} | {r['tensors']} | {r['gb']:.2f} | {r['seconds']:.2f} | {r['peak_above_start_mb']:.0f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
