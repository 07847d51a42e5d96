"""Many documents (`swiftwrite batch`): each a run of its own (run/), written one at a time on one loaded model,
side by side in worker processes (`--parallel N`, `auto` measured here), or by actors on a Ray cluster (`--ray`)."""
