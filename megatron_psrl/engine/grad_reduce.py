"""When each of megatron's gradient buckets starts its data-parallel reduce (``--overlap-grad-reduce``).

megatron-core's ``DistributedDataParallel`` keeps every gradient in contiguous fp32 buckets and,
with ``overlap_grad_reduce``, starts a bucket's asynchronous all-reduce (or, with the
distributed optimizer, reduce-scatter) from the backward hook of the last of its parameters:
on the last micro-batch (``is_last_microbatch``, cleared by ``no_sync``), once every parameter
of the bucket has had as many gradients as on the very first step. With prefix sharing a
step is many backward passes whose pattern follows the step's trees (micro-batches, a
producer's backward once its readers' K/V gradients are in, ranks without any micro-batch),
so neither a fixed micro-batch count nor the first step's counts say when a parameter's
gradient of the step is complete. The step's instruction stream does: after the step's last
model-running instruction nothing adds to any gradient.

:class:`BucketLaunches` replaces megatron's trigger (each bucket group's
``register_grad_ready``, called by DDP's hook after the gradient was added to ``main_grad``):

- outside the step's last backward (:meth:`arm` not called) a gradient only accumulates;
- during it, a bucket group is ready once every one of its parameters' hooks has run (each
  parameter's gradient-accumulator hook runs once per ``autograd.backward`` call, and the last
  backward instruction runs one per model chunk, each parameter in one chunk), a parameter
  that backward's graph does not reach counting as in from its start;
- ready groups start their reduce in one fixed order (model chunks last to first, as the
  backward runs them; within a chunk megatron's bucket order, which is the backward order of
  its parameters; dense before expert-parallel groups). Every data-parallel rank issues its
  collectives in that order whatever its backward touched, as collectives over one group must
  be: a bucket waits for the ones before it;
- :meth:`launch_rest` starts the groups not started yet (their parameters had no gradient in
  the last backward, or there was no armed backward at all: a rank without micro-batches, a
  call that is not the step's last), in the same order, before ``finalize_model_grads`` waits
  for all of them.

The reduction is megatron's own ``start_grad_sync`` over the same buckets with the same
operation: the numbers are those of launching every bucket after the backward. A gradient
that reaches a bucket already started would not be in its sum: it raises instead.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Set

import torch

from megatron_psrl.compat import megatron_optimizer_calls


class BucketLaunches:
    """The start of every bucket group's reduce for megatron DDPs ``ddps`` (one per model chunk)."""

    def __init__(self, ddps, device: torch.device):
        self.device = device
        self.order = [g for ddp in reversed(ddps) for g in ddp.bucket_groups + ddp.expert_parallel_bucket_groups]
        """Bucket groups in the order their reduces start, on every rank."""
        self.position = {id(g): k for k, g in enumerate(self.order)}
        self.names = {p: name for ddp in ddps for name, p in ddp.module.named_parameters()}
        self.armed = False
        """The step's last backward is running: ready groups start their reduce."""
        self.started = 0
        """Groups started since the gradients were zeroed (a prefix of :attr:`order`)."""
        self.arrived: Dict[int, Set[torch.nn.Parameter]] = {}
        """Group position -> its parameters whose gradient of the last backward is in."""
        for group in self.order:
            # megatron's DDP hook calls this after adding the gradient to main_grad; its own
            # counting (per_param_grad_ready_counts) is never used, so every group stays in its
            # "first batch" state and finish_grad_sync only waits for what was started here.
            group.register_grad_ready = self._hook(group)

    def _hook(self, group):
        def grad_ready(param: torch.nn.Parameter, force_all_reduce: bool = False) -> None:
            self.grad_ready(group, param)
        return grad_ready

    # ------------------------------------------------------------------ the step
    def reset(self) -> None:
        """Nothing armed or started: after ``finalize_model_grads`` waited for every reduce, and
        when the gradients are zeroed (a reduce still in flight, of a step abandoned after its
        last backward, is waited for first)."""
        for group in self.order:
            if group.grad_reduce_handle is not None:
                group.grad_reduce_handle.wait()
                group.grad_reduce_handle = None
        self.armed = False
        self.started = 0
        self.arrived = {}

    def arm(self, roots: Optional[Sequence[torch.Tensor]] = None) -> None:
        """The step's last backward starts, from ``roots``: each group's reduce starts once its
        gradients are in. A parameter that backward cannot reach (its autograd graph from
        ``roots``; e.g. the output layer in a backward that only injects a cached prefix's dK/dV)
        has its gradient of the step already: it counts as in from the start. No roots (a
        pipeline stage whose last backward has nothing to run: a micro-batch without a loss or
        a produced prefix in its layers) reach nothing: every group starts now, as on the
        stage's data-parallel peers, whose last backward starts theirs before the step's next
        collective over the group. ``roots`` None: not known, every gradient is waited for."""
        self.armed = True
        reached = reachable_parameters(roots) if roots is not None else None
        if reached is not None:
            for k, group in enumerate(self.order[self.started:], start=self.started):
                self.arrived.setdefault(k, set()).update(p for p in group.params if id(p) not in reached)
        self._start_ready()

    def grad_ready(self, group, param: torch.nn.Parameter) -> None:
        """DDP's hook: ``param``'s gradient of this backward pass is in ``main_grad``."""
        k = self.position[id(group)]
        if k < self.started:
            raise RuntimeError(
                f"a gradient of {self.names.get(param, 'a parameter')} arrived after its bucket's data-parallel "
                "reduce started (a backward pass after the one the step called its last); call optimizer_step "
                "before the next forward_backward, or turn --overlap-grad-reduce off")
        if not self.armed:
            return
        self.arrived.setdefault(k, set()).add(param)
        self._start_ready()

    def _start_ready(self) -> None:
        """Start the groups, in order, whose parameters' gradients are all in."""
        while self.started < len(self.order) and len(self.arrived.get(self.started, ())) == \
                len(self.order[self.started].params):
            self._start_next()

    def launch_rest(self) -> None:
        """Start every group not started yet, in :attr:`order`; nothing is armed afterwards."""
        self.armed = False
        while self.started < len(self.order):
            self._start_next()

    def _start_next(self) -> None:
        with megatron_optimizer_calls(self.device):
            self.order[self.started].start_grad_sync()
        self.started += 1

    @property
    def groups(self) -> List:
        """Every bucket group, in launch order."""
        return list(self.order)


def reachable_parameters(roots: Sequence[torch.Tensor]) -> Optional[Set[int]]:
    """``id``s of the leaf tensors a backward from ``roots`` reaches (their autograd graph), or
    None when that cannot be told from the graph: a reentrant activation checkpoint (megatron's
    ``CheckpointFunction``, Transformer Engine's) runs its parameters' backward inside its own
    node, whose graph holds only its inputs."""
    seen = set()  # the nodes themselves (held, so no id is reused while walking)
    reached: Set[int] = set()
    stack = [t.grad_fn for t in roots if t.grad_fn is not None]
    while stack:
        fn = stack.pop()
        if fn in seen:
            continue
        seen.add(fn)
        if "Checkpoint" in type(fn).__name__:
            return None
        leaf = getattr(fn, "variable", None)  # (an AccumulateGrad node: the leaf it accumulates into)
        if leaf is not None:
            reached.add(id(leaf))
        stack.extend(nxt for nxt, _ in fn.next_functions if nxt is not None)
    return reached
