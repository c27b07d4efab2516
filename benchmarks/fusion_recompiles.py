#!/usr/bin/env python
"""How often megatron's fused SwiGLU (``bias_activation_fusion``, ``torch.compile``d through
``megatron.core.jit.jit_fuser``) compiles when the rows of a micro-batch change every step.

    python benchmarks/fusion_recompiles.py --backend eager --rows 37,512,129,1000,77,2048,5,300,4097,61,1,900

Every row count runs megatron's ``bias_swiglu_impl`` on ``[rows, 1, 2 * ffn]`` forward and
backward, then forward without autograd; prints the frames dynamo compiled
(``torch._dynamo.utils.counters["frames"]["ok"]``). ``--backend inductor`` compiles as a
training run does (on CPU: C++ kernels, minutes); ``eager`` recompiles megatron's functions
with dynamo's eager backend: the same guards and recompilations, no code generation.
"""

import argparse
import time

import torch
from megatron.core.fusions import fused_bias_swiglu as fused
from torch._dynamo.utils import counters


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", choices=["inductor", "eager"], default="eager")
    p.add_argument("--rows", default="37,512,129,1000,77,2048,5,300,4097,61,1,900")
    p.add_argument("--ffn", type=int, default=64)
    args = p.parse_args()
    rows = [int(x) for x in args.rows.split(",")]
    if args.backend == "eager":
        for name in ("swiglu", "swiglu_back"):
            setattr(fused, name, torch.compile(getattr(fused, name)._torchdynamo_orig_callable, backend="eager"))
    torch._dynamo.reset()
    counters.clear()
    t0 = time.time()
    after = []
    for t in rows:
        x = torch.randn(t, 1, 2 * args.ffn, requires_grad=True)
        fused.bias_swiglu_impl(x, None).sum().backward()
        with torch.no_grad():
            fused.bias_swiglu_impl(x.detach(), None)
        after.append(counters["frames"]["ok"])
    print(f"backend {args.backend}, {len(rows)} row counts: {after[-1]} frames compiled "
          f"(after each: {after}), {time.time() - t0:.1f} s")


if __name__ == "__main__":
    main()
