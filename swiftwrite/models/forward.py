"""The forward interface: what the engine, the sampler, the budget measurement, the writer and the panel use of a
model. model.LeanModel (the lean Llama-family forward), hfmodel.HFModel (transformers, for other architectures) and
a CPU backend implement it; graphs.GraphedModel and parallel.Leader wrap a LeanModel and pass it through. Nothing
here runs: these are the names and shapes a new implementation must provide, checked by the type checker only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from ..base.modelconfig import ModelConfig


@dataclass(frozen=True)
class Abilities:
    """What a forward can do, declared by its implementation (and its probe): the one place callers learn it.

    The defaults describe a forward that computes any batch and any tree to a single step's bits (float32 torch,
    whose trees differ from steps only in the last bits, observed never to change a token)."""

    lean: bool = False  # the lean Llama-family forward (model.LeanModel, or a wrapper of it): tensor parallelism,
    # multi-token heads and --weights int8/int4 need it; the transformers fallback and llama.cpp are not it
    hidden: bool = True  # hidden states before the final norm are real (llama.cpp exposes none: no heads)
    exact_rows: bool = False  # trees keep single steps' bits only through exact.check's product pieces (half
    # precision, quantized products): the assembly runs the check before drafting, and drafts nothing if it fails
    pads_trees: bool = False  # a tree's products run over a measured row plan (ops.row_plan; float32 on a CPU):
    # the assembly measures the plan, and the cost curve prices trees at the padded counts
    row_plan: tuple[int, ...] | None = None  # that plan, once set (set_row_plan)
    max_rows: int | None = None  # most tokens one tree forward computes exactly (llama.cpp: measured); None: any
    steps_apart: bool = False  # single steps compute other bits than batches past some context (llama.cpp with
    # several threads): no trees, and the engine rebuilds the context a step at a time where it ran that way
    chains_only: bool = False  # only a tree's first chain (the first child of each node, in the forward's row order)
    # keeps single steps' bits: its other rows sit in cells out of position order, and llama.cpp's attention without
    # flash attention sums cells in SIMD lanes by cell. The engine verifies one path (DraftTree(chain=True))
    scratch_lengths: bool = True  # a forward may run past the committed tokens (cost curves of later contexts
    # measured ahead); llama.cpp checks each sequence's positions and cannot
    not_exact: str | None = None  # the probe's clause on why drafts could change the text here; None: no such finding
    governed: bool = False  # the thread count may change mid-run through counts a probe shows give the same bits
    # (threads.py's governor)
    saves_cells: str | None = None  # the cache's committed cells can be saved and put back bit for bit (save_cells,
    # load_cells): a resume loads them from the run directory instead of computing the context (llama.cpp). The value
    # names the build whose cells they are: a file of another is not put back


class Cache(Protocol):
    """Keys and values of the committed context (kvcache.KVCache, hfmodel.HFCache). A forward writes its tokens'
    K/V after the `length` committed slots and leaves `length` alone: the caller commits or compacts."""

    length: int  # committed slots; the engine sets it (commit, rollback, rebuild)
    capacity: int  # slots allocated (or allowed) in all

    @property
    def nbytes(self) -> int:
        """Bytes the cache holds (or grows to) at `capacity`: the budget and the memory check read it."""
        ...

    def written(self, end: int) -> list[torch.Tensor]:
        """Copies of what the first `end` slots hold (keys and values, in the cache's own form): the governor's probe
        compares them bit for bit across thread counts (caches of governed forwards only)."""
        ...

    def compact(self, start: int, keep: torch.Tensor) -> None:
        """Move slots `start + keep[i]` to `start + i` (a tree's accepted path) and set `length = start + len(keep)`."""
        ...

    def save_cells(self, start: int, end: int) -> bytes:
        """The committed slots start..end-1, serialized (caches of forwards that save cells only)."""
        ...

    def load_cells(self, blob: bytes, start: int, end: int) -> bool:
        """Put back what save_cells(start, end) gave, after the first `start` slots (`length` must be `start`); then
        `length` is `end`. False, and the cache as it was, where the bytes are refused."""
        ...


class Forward(Protocol):
    """A causal language model run on token ids, position by position, against a `Cache`.

    What it can do beyond this interface is its `abilities` (below): declared by each implementation, filled in by
    its probe where the machine decides, and read as fields by the assembly, the engine, the budget and the governor.
    """

    abilities: Abilities
    cfg: ModelConfig  # vocab_size, eos_token_ids, max_positions, n_layers, hidden_size ...
    device: torch.device
    dtype: torch.dtype

    @property
    def threads(self) -> int:
        """CPU threads the forward computes on (governed forwards only)."""
        ...

    def set_threads(self, threads: int) -> None:
        """Compute on `threads` CPU threads from the next forward on: the governor's lever (governed forwards
        only; the same bits at every count the probe allowed)."""
        ...

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
