"""The KV cache of the lean forward: keys and values of every layer in one preallocated buffer."""

from __future__ import annotations

import torch

from ..base.modelconfig import ModelConfig


class KVCache:
    """Keys and values for every layer, preallocated once: [layers, kv_heads, capacity, head_dim].

    Slots are positions in this buffer, not token positions: after a context rebuild the same slot holds a
    token at another absolute position. `length` counts committed slots; a forward writes after them.
    """

    def __init__(self, cfg: ModelConfig, capacity: int, device, dtype):
        shape = (cfg.n_layers, cfg.n_kv_heads, capacity, cfg.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.capacity = capacity
        self.length = 0

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2

    @staticmethod
    def bytes_needed(cfg: ModelConfig, capacity: int, dtype) -> int:
        return 2 * cfg.n_layers * cfg.n_kv_heads * capacity * cfg.head_dim * torch.finfo(dtype).bits // 8

    def written(self, end: int) -> list[torch.Tensor]:
        """Copies of what slots [0, end) hold (the thread probe compares them bit for bit)."""
        return [self.k[:, :, :end].clone(), self.v[:, :, :end].clone()]

    def compact(self, start: int, keep: torch.Tensor) -> None:
        """Move the slots `start + keep[i]` to `start + i` (the accepted path of a tree) in all layers."""
        n = keep.numel()
        if n and not bool((keep == torch.arange(n, device=keep.device)).all()):
            src = keep + start
            self.k[:, :, start : start + n] = self.k[:, :, src]
            self.v[:, :, start : start + n] = self.v[:, :, src]
        self.length = start + n

