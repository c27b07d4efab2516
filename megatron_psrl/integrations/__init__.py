"""Adapters to the RL frameworks people run (docs/integrations.md): ``slime`` (its train
data <-> samples). Each is imported on its own; none needs the framework installed to import."""
