"""The forward interface: what the engine, the sampler, the budget measurement, the writer and the panel use of a
model. model.LeanModel (the lean Llama-family forward), hfmodel.HFModel (transformers, for other architectures) and
a CPU backend implement it; graphs.GraphedModel and parallel.Leader wrap a LeanModel and pass it through. Nothing
here runs: these are the names and shapes a new implementation must provide, checked by the type checker only.
"""

from __future__ import annotations

from typing import Protocol

import torch

from .modelconfig import ModelConfig


class Cache(Protocol):
    """Keys and values of the committed context (kvcache.KVCache, hfmodel.HFCache). A forward writes its tokens'
    K/V after the `length` committed slots and leaves `length` alone: the caller commits or compacts."""

    length: int  # committed slots; the engine sets it (commit, rollback, rebuild)
    capacity: int  # slots allocated (or allowed) in all

    @property
    def nbytes(self) -> int:
        """Bytes the cache holds (or grows to) at `capacity`: the budget and the memory check read it."""
        ...

    def compact(self, start: int, keep: torch.Tensor) -> None:
        """Move slots `start + keep[i]` to `start + i` (a tree's accepted path) and set `length = start + len(keep)`."""
        ...


class Forward(Protocol):
    """A causal language model run on token ids, position by position, against a `Cache`.

    Optional attributes, read with getattr(model, name, default) where a model may lack them:
      exact_rows: bool = False  a tree's rows are computed to the bits of single steps (exact.py); the loader then
                                runs exact.check and the heads' drafts go through it (loading.py)
      pads_trees: bool = False  a tree's products run over ops.row_plan's counts, so the cost curve reads them
                                (loading.py, budget.CostCurve)
      fallback: bool = False    the transformers fallback (hfmodel.HFModel): no multi-token heads (loading.py)
      hidden: bool = True       the hidden states are real (ggmlmodel.GgmlModel: no, so no heads)
      max_rows: int             most tokens one tree forward computes exactly (ggmlmodel: measured at load); trees
                                and the cost curve stay within it (engine.py, budget.py)
      scratch_lengths: bool = True  a forward may run at cache.length past the committed tokens (the cost curve of
                                a later context bucket, measured ahead: loading.fit_budget); llama.cpp cannot
      model                     the wrapped LeanModel of a graphs.GraphedModel (exact.check sets its `rows`)
    """

    cfg: ModelConfig  # vocab_size, eos_token_ids, max_positions, n_layers, hidden_size ...
    device: torch.device
    dtype: torch.dtype

    def new_cache(self, capacity: int) -> Cache:
        """An empty cache of `capacity` slots, preallocated where the model can."""
        ...

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, cache: Cache, mask: torch.Tensor | None = None,
                logits_for: torch.Tensor | slice | None = None, kv=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Run `ids` [n] at absolute `positions` [n] after the cache's committed slots. `mask`: None (causal), a
        bool [n, n] over the new tokens (each sees the whole cache) or [n, cache.length + n]. Returns (logits
        float32 [n, or the rows `logits_for` selects, vocab], hidden states before the final norm [n, hidden_size],
        or [n, 0] where the model does not expose them). `kv`: a one-token draft forward against
        draftcache.PartialCache instead of `cache` (LeanModel only)."""
        ...
