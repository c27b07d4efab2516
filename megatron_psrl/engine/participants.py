"""What takes part in every instruction of a step without being one: the step's participants.

The executor (:class:`~megatron_psrl.engine.step.StepRunner`) runs a rank's instructions
(:mod:`megatron_psrl.schedule.instructions`) one method per kind; concerns that span the whole
step attach to it here, each through the same hooks:

- ``begin(step)`` / ``end(step)``: around the step, in the order the runner lists them;
- ``before(instruction, step)``: before every instruction;
- ``before_graph_backward(instruction, step)``: inside a :class:`Backward`, after a dropped
  graph was recomputed and right before autograd runs.

``step`` is the executor's state of the call (:class:`~megatron_psrl.engine.step.StepState`).
"""

from __future__ import annotations

from typing import List, Tuple

from megatron_psrl.engine.head_sends import HeadSends
from megatron_psrl.model.gpt import model_chunks
from megatron_psrl.schedule.instructions import Instruction, last_backward, lockstep_passes


class StepParticipant:
    """A concern of the whole step (module docstring); every hook does nothing by default."""

    def begin(self, step) -> None:
        pass

    def before(self, instruction: Instruction, step) -> None:
        pass

    def before_graph_backward(self, instruction: Instruction, step) -> None:
        pass

    def end(self, step) -> None:
        pass


class ExpertLockstep(StepParticipant):
    """MoE with expert parallelism: the group's MoE layers exchange tokens in every pass, so every
    rank runs its passes in a common schedule, with empty passes where it has none
    (:class:`megatron_psrl.model.moe.ExpertLockstep`); before each of this rank's passes the
    lockstep first runs the empty passes the common schedule puts before it."""

    def __init__(self, runner, instructions: List[Instruction]):
        self.runner = runner
        self.passes = lockstep_passes(instructions)
        self.lockstep = None

    @staticmethod
    def participant_key(plan, rank: int) -> Tuple[str, int]:
        """Who runs this rank's passes together, as one participant of the lockstep: the whole
        exchange group of a cross-rank plan (its ranks run one schedule and exchange K/V inside
        every pass, so none may run an empty pass while another runs its own: the lockstep runs
        kept forwards and backwards one participant at a time), else the rank (with its
        tensor-parallel peers, which share its placement rank)."""
        if plan.ranks[rank].cross_rank:
            return ("exchange group", min(next(g for g in plan.groups if rank in g)))
        return ("rank", rank)

    def begin(self, step) -> None:
        from megatron_psrl.model.moe import ExpertLockstep as Lockstep
        from megatron_psrl.model.moe import moe_layers, recompute_units

        chunks = model_chunks(self.runner.model)
        layers = [layer for chunk in chunks for layer in moe_layers(chunk)]
        config = chunks[0].config
        # (activation recomputation: the empty passes checkpoint the MoE layers as the model does)
        self.lockstep = Lockstep(layers, self.runner.expert_group, self.passes, config.hidden_size,
                                 config.params_dtype, self.runner.device, units=recompute_units(chunks),
                                 peer_key=self.participant_key(step.plan, step.rank))

    def before(self, instruction: Instruction, step) -> None:
        if instruction.pass_kind is not None:
            self.lockstep.own(instruction.pass_kind)

    def end(self, step) -> None:
        self.lockstep.finish()
        self.runner.last_empty_expert_passes = self.lockstep.empty_passes


class RouterState(StepParticipant):
    """MoE router replay and router losses across the step: the losses' sums begin with a
    training step and are reported at its end; a backward that recomputes its forward routes
    (and weighs) its tokens as that forward did; the routers' own top-k again after the step."""

    def __init__(self, runner, training: bool):
        self.runner, self.training = runner, training

    def begin(self, step) -> None:
        if self.training and self.runner.router_losses is not None:
            self.runner.router_losses.begin_step(step.plan.tree, step.loss_scale)

    def before_graph_backward(self, instruction: Instruction, step) -> None:
        runner, i = self.runner, instruction.micro_batch
        if i in step.held_routes:  # a recomputing backward routes its tokens as their forward did
            # (virtual stages: every chunk's backward; the micro-batch's last, chunk 0's, lets them go)
            last = getattr(instruction, "chunk", None) in (None, 0)
            runner.replayer.set(*(step.held_routes.pop(i) if last else step.held_routes[i]))
        if runner.router_losses is not None:  # (and weighs them as their forward did)
            runner.router_losses.select(i)

    def end(self, step) -> None:
        self.runner.end_replay()
        if self.training and self.runner.router_losses is not None:
            # once per step: the terms' sums over this rank's micro-batches
            step.extra_losses.update(self.runner.router_losses.end_step())


class HeadExchange(StepParticipant):
    """A plan with heads sent between exchange groups: this rank's part in the protocol
    (:class:`~megatron_psrl.engine.head_sends.HeadSends`) is opened at the start of the step
    (its first messages posted) and closed at its end (every send complete); the instructions
    that send and receive heads use it through ``step.head_sends``."""

    def __init__(self, runner, training: bool):
        self.runner, self.training = runner, training

    def begin(self, step) -> None:
        if self.runner.head_send_group is None:
            raise RuntimeError("a plan with heads sent between groups needs the runner's head_send_group")
        step.head_sends = HeadSends(step.plan, step.rank, self.runner.kv_cache, self.runner.head_send_group,
                                    self.training)

    def end(self, step) -> None:
        step.head_sends.finish()


class KVCacheLifecycle(StepParticipant):
    """The KV cache's pool for the step: sized by the memory plan when the rank caches prefixes
    (and emptied at the end), released when a training step caches none."""

    def __init__(self, cache, training: bool):
        self.cache, self.training = cache, training
        self.caching = False

    def begin(self, step) -> None:
        self.caching = bool(step.rank_plan.sources)
        if self.caching:  # (a memory plan exists: StepRunner checks before lowering the plan)
            memory = step.memory
            self.cache.begin_step(memory.block_size, memory.pool_blocks, memory.pool_sizes or None,
                                  memory.pool_states or None, memory.pool_block_sizes or None)
        elif self.cache is not None and self.training:
            self.cache.release_pool()  # a step without cached prefixes holds no KV memory

    def end(self, step) -> None:
        if self.caching:
            self.cache.end_step()


class HostResidency(StepParticipant):
    """Host offload (a memory plan's ``host_offload``): the step's
    :class:`~megatron_psrl.engine.host_offload.HostOffload`, made once the KV pool is sized (the
    ``Residency`` instructions and kept forwards use it through ``step.host``), checked at the
    end, and what it moved kept on the runner (``last_host_offload``)."""

    def __init__(self, runner):
        self.runner = runner

    def begin(self, step) -> None:
        from megatron_psrl.engine.host_offload import HostOffload

        step.host = HostOffload(self.runner.host_link, self.runner.kv_cache, self.runner.model)

    def end(self, step) -> None:
        step.host.finish()
        self.runner.last_host_offload = step.host.record


class LastBackward(StepParticipant):
    """The step's last backward pass (:func:`~megatron_psrl.schedule.instructions.last_backward`):
    the optimizer is told right before its autograd call starts (``arm(roots)``, through the
    runner's ``_arm_backward``), so that each gradient bucket's data-parallel reduce starts as
    soon as that pass has produced its gradients (``--overlap-grad-reduce``,
    :mod:`megatron_psrl.engine.grad_reduce`); earlier passes only accumulate. Only in a call
    whose backward is the last before the optimizer step."""

    def __init__(self, runner, instructions: List[Instruction]):
        self.runner = runner
        self.instructions = instructions
        self.at = None
        self.position = 0

    def begin(self, step) -> None:
        if step.plan.head_sends:
            # A plan that sends heads between groups: a rank's point-to-point head messages and
            # its peers' bucket reduces interleave differently on each rank (a gloo run fails on
            # a message-size mismatch), so every bucket starts after the step's last backward.
            self.at = None
            return
        self.at = last_backward(self.instructions, empty=lambda x: self.runner.runs_no_backward(x, step))

    def before(self, instruction: Instruction, step) -> None:
        if self.position == self.at:
            step.pending_arm = self.runner.arm_grad_reduce
        self.position += 1

    def end(self, step) -> None:
        step.pending_arm = None  # (a last pass without any autograd call arms nothing)


def step_participants(runner, step, instructions: List[Instruction], training: bool) -> List[StepParticipant]:
    """The participants of one call, in the order their hooks run (``begin`` and ``end`` alike):
    the step's KV pool is sized before anything else allocates (ending it first only checks
    that nothing is held), the expert lockstep's trailing empty passes run before the
    routers' replay ends, and the gradient reduce is armed after every other participant's
    ``before`` (the lockstep's empty passes before a backward included)."""
    out: List[StepParticipant] = [KVCacheLifecycle(runner.kv_cache, training)]
    if runner.expert_group is not None:
        out.append(ExpertLockstep(runner, instructions))
    out.append(RouterState(runner, training))
    if step.plan.head_sends:
        out.append(HeadExchange(runner, training))
    if training and step.memory is not None and step.memory.host_offload:
        out.append(HostResidency(runner))
    # (not with the expert lockstep: its trailing empty passes run backwards after the last one)
    if training and step.last_of_step and runner.arm_grad_reduce is not None and runner.expert_group is None:
        out.append(LastBackward(runner, instructions))
    return out
