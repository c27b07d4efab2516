"""The RL-facing layer: the policy losses (``loss``) and :class:`~megatron_psrl.rl.actor.PolicyActor`
(``actor``), the in-memory API RL frameworks call, a thin layer over the engine."""
