"""Arithmetic on tensors, below any model: the shared ops, KV caches, tree attention, quantized kernels, weight files
on disk, and the rules that keep a tree's rows to a single step's bits (exact)."""
