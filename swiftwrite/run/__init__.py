"""A document from start to end: the assembly that turns a validated configuration into a running session (device,
ranks, model, engine, drafters, budget, outline), the session's loop with checkpoints and interruptions, edited
rounds, and the writer that `generate` and `resume` call. Many documents are batch/'s, the bench bench/'s."""
