"""A run's input and output, without a model: prompts and templates to ids, the run directory with its checkpoints
and rounds, and the terminal panel."""
