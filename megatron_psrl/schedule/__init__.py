"""Planning a step: who computes which tree tokens, in which micro-batches, in which order.

- ``cost``: the cost model (FLOPs, or measured seconds, per token, key pair, logit row);
- ``group_split``: trees split between exchange groups, and the heads sent between them;
- ``config``: :class:`PlannerConfig`, the layout, budgets and costs the planner plans for;
- ``planner``: :func:`plan_step`, the placement over ranks and groups;
- ``rank_layout``: one rank's micro-batches for the trees placed on it whole;
- ``cross_rank``: a group's trees split into equal-cost fragments over its ranks (lockstep);
- ``packing``: a micro-batch's tokens serialised for the model (ids, positions, attention);
- ``plan``: the plan's types (:class:`StepPlan`, :class:`RankPlan`, ...); ``check``: ``check_plan``;
- ``memory``: the KV memory plan (blocks, kept graphs) of a rank or a lockstep group;
- ``with_memory``: the step and its memory planned together (cut differently when tight);
- ``instructions``: a rank's plan as the typed instructions the engine executes.

Import the modules themselves (``from megatron_psrl.schedule.planner import plan_step``);
this package file imports nothing, so that importing one part does not load them all.
"""
