"""A document from start to end: the assembly that turns a validated configuration into a running session (device,
ranks, model, engine, drafters, budget, outline), the session's loop with checkpoints and interruptions, edited
rounds, the writer that `generate` and `resume` call, and the bench harness."""
