"""GPU kernels for swiftwrite (optional: they need triton). tree_attention: tree-verification attention."""
