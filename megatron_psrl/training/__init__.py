"""The command line's training loop (``pretrain_agent_rl.py``): its arguments, the loop
around a PolicyActor, metrics logging and start-up checks of what the run writes."""
