"""The llama.cpp backend: ggml's CPU kernels behind the forward interface the lean forward offers.

A GGUF model runs inside llama.cpp (through llama-cpp-python's low-level API); the engine, the sampler, the
drafters, the writer and the panel stay ours. `GgmlModel.forward(ids, positions, cache, mask, logits_for)` behaves
like `LeanModel.forward`: the new tokens' keys and values land after the cache's committed slots, `cache.length` is
left for the caller to advance (or `cache.compact` to rewrite), and the logits come back as float32 rows for our
sampler to process (penalty, DRY, min-p, position-seeded noise: nothing of llama.cpp's sampling is used).

**The cache is llama.cpp's, addressed by sequence ids.** Committed tokens live in one sequence (`cache.main`) at
positions equal to their slots. A draft tree is verified in one batch: every leaf gets its own sequence id, every
node carries the ids of the leaves below it, and the committed context is shared into every leaf's sequence (a
unified cache: one cell, several ids). A node then attends to the context and to the nodes on its own path only,
which is exactly the ancestor mask (how llama.cpp's own speculative example builds trees). After verification,
`compact` keeps the sequence of one leaf below the last accepted node, cut after that node, and drops everything
else: the accepted path is already at the right positions, nothing moves.

**Bits that depend only on the tokens.** Loaded as `INVARIANT` says (no repacked weights, attention without flash
attention, tiled K-quant products off) in a binding built without llamafile, every output element is one whole dot
product: a row's bits depend on neither the rows beside it nor the thread count. ggmlprobe.py checks that at start-up
rather than trusting it, and the finding (`apply`) decides what runs: trees of up to `max_rows` rows, prefills in
batches of `batch_rows`, the governor (`set_threads`) where one thread computes the run's bits.

**Where single steps part from batches** (`steps_apart`: a binding built with llamafile, loaded as `STOCK`, where with
more than one thread llama.cpp splits a single query's attention over 512 or more cells across its threads and a
batch's not), drafting is off and the engine keeps each position's kind of computation the same in every run: a
context rebuild (and the start of a run) prefills in batches what the running engine had prefilled in batches, and
the tokens it had written a step at a time after that rebuild a step at a time again (Engine._rebuild).
"""

from __future__ import annotations

import ctypes
import weakref
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..base.errors import UserError
from .forward import Abilities
from .ggmlbinding import binding, build_key, forget_messages, last_message, rebuild_hint
from .ggmlprobe import Finding

MAX_ROWS = 128  # rows one llama_decode may carry (a forward over more runs in several)
MAX_SEQS = 64  # sequence ids: the most leaves a tree of MAX_BUDGET + 1 nodes has
CTX_STEP = 256  # llama.cpp contexts are sized in these steps


def context_cells(capacity: int) -> int:
    """The cells of the llama.cpp context made for `capacity` slots: a tree may sit past the last slot."""
    return -(-(capacity + MAX_ROWS) // CTX_STEP) * CTX_STEP


def memory_bytes(cfg, capacity: int) -> tuple[int, int]:
    """What a context for `capacity` slots holds besides the mapped weights: (KV cache, compute and output buffers).
    Keys and values in float16; without flash attention the compute buffer's largest tensors are a ubatch's
    attention scores and mask in float32 (cells x MAX_ROWS x (heads + 1)), or its logits where that is more; the
    output buffer holds the logits of MAX_SEQS rows. Checked against llama.cpp's own log of its buffers on the
    default model at 2,048 / 8,448 / 33,024 cells (45.0 / 185.6 / 725.6 MiB KV, 24.8 / 42.9 / 162.9 MiB compute,
    12.0 MiB output, 2026-12-07)."""
    cells = context_cells(capacity)
    kv = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * cells * 2
    scores = cells * MAX_ROWS * (cfg.n_heads + 1) * 4
    logits = MAX_ROWS * cfg.vocab_size * 4
    return kv, max(scores, logits) + (2 << 20) + MAX_SEQS * cfg.vocab_size * 4


@dataclass(frozen=True)
class Loading:
    """How a model is loaded into llama.cpp: `flash_attn` is llama.cpp's flash_attn_type, `repack` its
    use_extra_bufts (repacked Q4_0 / Q4_K / IQ4_NL weights)."""

    flash_attn: int
    repack: bool


INVARIANT = Loading(flash_attn=0, repack=False)  # a row's bits from its tokens alone (with a build without llamafile)
# repacked weights without flash attention: Q4_0 / Q4_K / IQ4_NL products as fast as llama.cpp's own (an 8B-shaped
# Q4_0 step: 94 ms against the invariant loading's 139, 2026-12-06), a batch of 4+ rows with other bits than single
# steps: no trees, exact by the engine's replay (steps_apart; probe(trees=False)), threads without effect (the
# governor). --backend ggml-repacked; auto takes it where it is faster (backends.REPACKED_FASTER)
REPACKED = Loading(flash_attn=0, repack=True)
STOCK = Loading(flash_attn=1, repack=True)  # llama.cpp's fast paths: batches keep single steps' bits at short context

class GgmlCache:
    """A llama.cpp context: its KV cache and the batch buffers the forwards fill. `length` counts committed slots."""

    def __init__(self, model: "GgmlModel", capacity: int):
        lib = model.lib
        self.model, self.capacity, self.length = model, capacity, 0
        spare = model.take_spare(context_cells(capacity))
        if spare is not None:  # a context a finished engine left: emptied, it is what a new one would be
            self.ctx, self.mem, self.n_ctx = spare
            lib.llama_memory_clear(self.mem, True)
            lib.llama_set_n_threads(self.ctx, model.threads, model.threads)
            self._empty(model)
            return
        params = lib.llama_context_default_params()
        params.n_ctx = context_cells(capacity)
        params.n_batch = params.n_ubatch = MAX_ROWS  # one forward is one ubatch: its rows are computed together
        params.n_seq_max = MAX_SEQS
        params.kv_unified = True  # the context's cells are shared by every leaf's sequence, not copied
        params.n_threads = params.n_threads_batch = model.threads
        params.flash_attn_type = model.loading.flash_attn
        params.no_perf = True
        self.ctx = lib.llama_init_from_model(model.handle, params)
        if not self.ctx:
            raise UserError(f"llama.cpp could not make a {params.n_ctx}-token context for {model.path.name} "
                            f"({last_message()}); use a smaller --context.")
        self.mem = lib.llama_get_memory(self.ctx)
        self.n_ctx = params.n_ctx
        self._empty(model)

    def _empty(self, model: "GgmlModel") -> None:
        self.main = 0  # the sequence id holding the committed tokens
        self.high = 0  # one past the highest position any forward wrote (cells past `length` to drop)
        self.tree: list[list[int]] | None = None  # the last forward's sequence ids per node, while it was a tree
        self.nbytes = memory_bytes(model.cfg, self.capacity)[0]  # f16 keys and values

    def plan_tree(self, mask: torch.Tensor, ids: torch.Tensor) -> np.ndarray:
        """Sequence ids for a tree's nodes (those of the leaves below each: mask[i, j] = j is an ancestor of i or i
        itself), and the batch order, returned: depth first, each node's children in their order, so the chain of
        first children fills the first rows. The first leaf keeps the main sequence; the others get fresh ids with
        the context shared into them.

        Why the order: llama.cpp gives a batch's rows consecutive cells, and attention sums over cells in cell order,
        so the committed tokens must sit in cells in the order of their positions, as a plain run puts them (cell =
        position). When the accepted path is the batch's first rows it already does; otherwise `compact` writes it
        again (see there). The first children are the sources' best guesses, so that is the common case."""
        anc = mask.cpu().numpy()
        n = anc.shape[0]
        depth = anc.sum(axis=1) - 1
        proper = anc & ~np.eye(n, dtype=bool)
        parent = np.where(proper.any(axis=1), np.argmax(np.where(proper, depth[None, :], -1), axis=1), -1)
        children: list[list[int]] = [[] for _ in range(n)]
        for i in range(1, n):
            children[parent[i]].append(i)
        order, stack = [], [0]
        while stack:
            i = stack.pop()
            order.append(i)
            stack.extend(reversed(children[i]))
        leaves = [i for i in order if not children[i]]
        if len(leaves) > MAX_SEQS:
            raise RuntimeError(f"a tree of {len(leaves)} leaves; the llama.cpp context has {MAX_SEQS} sequences")
        lib = self.model.lib
        seqs = [self.main] + [s for s in range(MAX_SEQS) if s != self.main][: len(leaves) - 1]
        for s in seqs[1:]:
            lib.llama_memory_seq_cp(self.mem, self.main, s, -1, -1)
        tree: list[list[int]] = [[] for _ in range(n)]
        for leaf, s in zip(leaves, seqs):
            for j in np.flatnonzero(anc[leaf]):
                tree[j].append(s)
        self.tree, self.tokens = tree, ids.tolist()
        self.row = np.empty(n, dtype=np.int64)
        self.row[np.asarray(order)] = np.arange(n)
        return np.asarray(order)

    def compact(self, start: int, keep: torch.Tensor) -> None:
        """Keep the tree nodes `keep` (the accepted path, root first) at slots start.., drop the rest."""
        lib, keep, n = self.model.lib, keep.tolist(), int(keep.numel())
        if self.tree is not None:
            if [int(self.row[i]) for i in keep] == list(range(n)):  # the path is the batch's first rows: in place
                leaf_seq = self.tree[keep[-1]][0]  # a leaf below the last kept node: its path holds every kept node
                lib.llama_memory_seq_keep(self.mem, leaf_seq)  # the other branches and the context's other ids go
                lib.llama_memory_seq_rm(self.mem, leaf_seq, start + n, -1)  # the path's nodes past the kept ones
                self.main = leaf_seq
            else:
                # another branch was accepted: its cells sit after rejected ones, out of position order. Drop the
                # tree and write the path again as one batch, with no logits (a batch's rows are a single step's,
                # the probe made sure), into cells start.. in order
                lib.llama_memory_seq_rm(self.mem, -1, start, -1)
                lib.llama_memory_seq_keep(self.mem, self.main)
                self.tree = None  # the re-write below is a plain causal forward
                self.model.forward(torch.tensor([self.tokens[i] for i in keep]), torch.arange(start, start + n), self,
                                   logits_for=slice(0, 0))
            self.tree = None
        elif self.high > start + n:
            lib.llama_memory_seq_rm(self.mem, -1, start + n, -1)
        self.length = self.high = start + n

    def written(self, end: int) -> list[torch.Tensor]:
        """What the committed sequence's cells hold (llama.cpp's serialized state of it, keys and values: the thread
        probe compares it bit for bit); `end` is implied by the sequence."""
        lib = self.model.lib
        size = lib.llama_state_seq_get_size(self.ctx, self.main)
        buf = (ctypes.c_uint8 * size)()
        got = lib.llama_state_seq_get_data(self.ctx, buf, size, self.main)
        return [torch.frombuffer(bytearray(buf)[:got], dtype=torch.uint8)]

    def save_cells(self, start: int, end: int) -> bytes:
        """The committed cells at positions start..end-1 as llama.cpp serializes a sequence (keys and values, bit for
        bit): copied into a spare sequence id first, so only they are written. No tree is live between steps, so
        any id but the main one is free."""
        lib, spare = self.model.lib, 1 if self.main == 0 else 0
        self._drop_tree()
        lib.llama_memory_seq_rm(self.mem, spare, -1, -1)
        lib.llama_memory_seq_cp(self.mem, self.main, spare, start, end)
        try:
            size = lib.llama_state_seq_get_size(self.ctx, spare)
            buf = (ctypes.c_uint8 * size)()
            got = lib.llama_state_seq_get_data(self.ctx, buf, size, spare)
            return bytes(memoryview(buf)[:got])
        finally:
            lib.llama_memory_seq_rm(self.mem, spare, -1, -1)

    def load_cells(self, blob: bytes, start: int, end: int, shift: int = 0) -> bool:
        """Put back cells save_cells(start - shift, end - shift) gave, at positions start..end-1 (`shift`: the probe
        fills a long context with copies of a short one; llama.cpp rotates the keys by the shift). llama.cpp places
        a sequence's saved cells in the first free run of cells, which after the `start` committed ones (cell =
        position, as a prefill leaves them) is start..end-1: where the running engine had them, so attention sums
        them in the same lanes. Read into a spare sequence id (llama.cpp clears the one it reads into), then shared
        into the main one."""
        if self.length != start:
            raise RuntimeError(f"cells {start}..{end} loaded after {self.length} committed slots")
        lib, spare = self.model.lib, 1 if self.main == 0 else 0
        self._drop_tree()
        lib.llama_memory_seq_rm(self.mem, -1, start, -1)  # whatever an earlier forward left past the committed
        buf = (ctypes.c_uint8 * len(blob)).from_buffer_copy(blob)
        if not lib.llama_state_seq_set_data(self.ctx, buf, len(blob), spare):
            lib.llama_memory_seq_rm(self.mem, spare, -1, -1)
            return False
        if shift:
            lib.llama_memory_seq_add(self.mem, spare, 0, -1, shift)
        lib.llama_memory_seq_cp(self.mem, spare, self.main, -1, -1)
        lib.llama_memory_seq_rm(self.mem, spare, -1, -1)
        if lib.llama_memory_seq_pos_max(self.mem, self.main) != end - 1:  # not the stretch it claimed to be
            lib.llama_memory_seq_rm(self.mem, -1, start, -1)
            return False
        self.length = self.high = end
        return True

    def _drop_tree(self) -> None:
        if self.tree is not None:  # an uncompacted tree left the context shared into its leaves' sequences
            self.model.lib.llama_memory_seq_keep(self.mem, self.main)
            self.tree = None

    def close(self) -> None:
        if getattr(self, "ctx", None):
            self.model.lib.llama_free(self.ctx)
            self.ctx = None

    def __del__(self) -> None:
        """An engine that is done drops its cache: its context goes to the model as the spare for the next cache of
        its size (a batch's next document) rather than freed, since llama.cpp takes 0.2-1 s to make one (allocating
        and clearing the KV cache, reserving the compute graphs)."""
        if getattr(self, "ctx", None):
            self.model.keep_spare(self.ctx, self.mem, self.n_ctx)
            self.ctx = None


class GgmlModel:
    """A GGUF model in llama.cpp behind LeanModel's interface (see the module docstring)."""

    def __init__(self, path: Path, cfg, threads: int, loading: Loading = INVARIANT):
        """`cfg`: the model's ModelConfig (sizes, end ids, positions), read from the store's config.json.
        `loading`: INVARIANT (the path the probe is meant to confirm) or STOCK (llama.cpp's fast paths)."""
        self._spare: tuple | None = None  # keep_spare: a dropped cache's context, for the next of its size
        self.lib = lib = binding()
        self.path, self.cfg, self.threads, self.loading = Path(path), cfg, threads, loading
        self.device, self.dtype = torch.device("cpu"), torch.float32
        self._caches: weakref.WeakSet[GgmlCache] = weakref.WeakSet()  # open contexts: set_threads reaches each
        params = lib.llama_model_default_params()
        params.n_gpu_layers = 0
        params.use_extra_bufts = loading.repack
        forget_messages()  # last_message() then says why this load failed
        self.handle = lib.llama_model_load_from_file(str(self.path).encode(), params)
        if not self.handle:
            raise UserError(f"llama.cpp cannot load {self.path} ({last_message()}); use --backend torch, or check "
                            "the file.")
        self.vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(self.handle))
        if self.vocab != cfg.vocab_size:
            raise UserError(f"{self.path.name} has {self.vocab} tokens in llama.cpp and {cfg.vocab_size} in its "
                            "configuration; the tokenizer would not match, use --backend torch.")
        self.batch = lib.llama_batch_init(MAX_ROWS, 0, MAX_SEQS)
        b = self.batch
        self._tok = np.ctypeslib.as_array(b.token, shape=(MAX_ROWS,))
        self._pos = np.ctypeslib.as_array(b.pos, shape=(MAX_ROWS,))
        self._nseq = np.ctypeslib.as_array(b.n_seq_id, shape=(MAX_ROWS,))
        self._out = np.ctypeslib.as_array(b.logits, shape=(MAX_ROWS,))
        self._seq = [b.seq_id[i] for i in range(MAX_ROWS)]
        # llama_get_logits returning the address as an int: the binding's own returns a pointer object, and with the
        # cast to an address that cost ~40 us a step in a timed run (a cold ctypes path after every llama_decode)
        self._logits_at = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)(
            ctypes.cast(lib.llama_get_logits, ctypes.c_void_p).value)
        self._no_hidden: dict[int, torch.Tensor] = {}  # _hidden
        # rows a tree may carry (max_rows) and a prefill's batches (batch_rows): the probe's finding (apply)
        self.apply(Finding(batch_rows=1, max_rows=1))  # a step at a time until probed

    @property
    def abilities(self) -> Abilities:
        """No state before the final norm (multi-token heads cannot read it). A forward must follow the committed
        positions (llama.cpp checks each sequence's positions), so a cost curve cannot be measured at a scratch
        length past them: one curve, measured at the run's start, serves the whole run (curves.Curves). The rest
        is the probe's: trees, rebuilds and the governor."""
        f = self.found
        note = f"{f.note}{rebuild_hint()}" if f.note else None
        return Abilities(hidden=False, scratch_lengths=False, max_rows=f.max_rows, steps_apart=f.steps_apart,
                         chains_only=not f.branches, not_exact=note, governed=not f.threads_apart,
                         saves_cells=build_key())

    @property
    def weight_bytes(self) -> int:
        return int(self.lib.llama_model_size(self.handle))

    def new_cache(self, capacity: int) -> GgmlCache:
        cache = GgmlCache(self, capacity)
        self._caches.add(cache)
        return cache

    def take_spare(self, n_ctx: int) -> tuple | None:
        """The spare context (keep_spare) if it has `n_ctx` cells; another size is freed."""
        spare, self._spare = self._spare, None
        if spare is not None and spare[2] == n_ctx:
            return spare
        if spare is not None:
            self.lib.llama_free(spare[0])
        return None

    def keep_spare(self, ctx, mem, n_ctx: int) -> None:
        """Keep a dropped cache's context (one; a second frees the first). Its cells are cleared when it is taken."""
        if not getattr(self, "handle", None):  # the model is closed: nothing to reuse it with
            self.lib.llama_free(ctx)
            return
        if self._spare is not None:
            self.lib.llama_free(self._spare[0])
        self._spare = (ctx, mem, n_ctx)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, cache: GgmlCache, mask: torch.Tensor | None = None,
                logits_for=None, kv=None) -> tuple[torch.Tensor, torch.Tensor]:
        if kv is not None:
            raise ValueError("the llama.cpp backend has no partial draft cache (two-pass heads)")
        n, start, lib = ids.shape[0], cache.length, self.lib
        if start + n > cache.capacity:
            raise RuntimeError(f"KV cache overflow: {start + n} slots needed, {cache.capacity} allocated")
        if cache.high > start:  # an earlier forward's uncommitted tokens (a cost measurement, a step cut short)
            lib.llama_memory_seq_rm(cache.mem, -1, start, -1)
        if cache.tree is not None:  # an uncompacted tree left the context shared into its leaves' sequences
            lib.llama_memory_seq_keep(cache.mem, cache.main)
            cache.tree = None
        ids_np, pos_np = ids.numpy(), positions.numpy()
        cache.high = max(start, int(pos_np.max()) + 1)
        wanted = np.zeros(n, dtype=bool)
        rows = np.arange(n) if logits_for is None else np.arange(n)[logits_for]
        wanted[rows] = True
        if mask is not None and n > 1:
            if n > self.max_rows:
                raise RuntimeError(f"a tree of {n} nodes; llama.cpp computes {self.max_rows} rows exactly here")
            order = cache.plan_tree(mask, ids)  # batch row -> node: the first child's chain first
            got = self._decode(cache, ids_np[order], pos_np[order], wanted[order], cache.tree, order)
            at = np.full(n, -1, dtype=np.int64)
            at[order[wanted[order]]] = np.arange(int(wanted.sum()))
            return torch.from_numpy(got[at[rows]]), self._hidden(n)
        # causal tokens (a step, a prefill): in batches of at most batch_rows, the most whose rows keep a single
        # step's bits here (the probe), so a prefilled context equals one written a token at a time (up to ~512
        # cells where steps_apart)
        parts = []
        for a in range(0, n, self.batch_rows):
            b = min(n, a + self.batch_rows)
            parts.append(self._decode(cache, ids_np[a:b], pos_np[a:b], wanted[a:b]))
        got = parts[0] if len(parts) == 1 else np.concatenate(parts)
        if len(rows) == len(got) and (len(rows) < 2 or rows[0] < rows[-1]):  # every wanted row, in order
            return torch.from_numpy(got), self._hidden(n)
        at = np.cumsum(wanted) - 1
        return torch.from_numpy(got[at[rows]]), self._hidden(n)

    def _hidden(self, n: int) -> torch.Tensor:
        """The [n, 0] hidden states a forward returns (llama.cpp exposes none): made once per size, not every step."""
        h = self._no_hidden.get(n)
        if h is None:
            h = self._no_hidden[n] = torch.empty(n, 0)
        return h

    def _decode(self, cache: GgmlCache, ids, pos, out, tree=None, order=None) -> np.ndarray:
        """One llama_decode over rows given in batch order; the logits of the rows flagged in `out`, copied."""
        m = len(ids)
        self._tok[:m] = ids
        self._pos[:m] = pos
        self._out[:m] = out
        if tree is None:
            self._nseq[:m] = 1
            for i in range(m):
                self._seq[i][0] = cache.main
        else:
            for r, node in enumerate(order):
                seqs = tree[node]
                self._nseq[r] = len(seqs)
                row = self._seq[r]
                for k, s in enumerate(seqs):
                    row[k] = s
        self.batch.n_tokens = m
        rc = self.lib.llama_decode(cache.ctx, self.batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode failed ({rc}: {last_message()})")
        k = int(np.count_nonzero(out))
        if not k:
            return np.empty((0, self.vocab), dtype=np.float32)
        return self._logits(cache, k).copy()

    def _logits(self, cache: GgmlCache, k: int) -> np.ndarray:
        """The last decode's `k` rows of logits, a view of llama.cpp's buffer (valid until the next decode)."""
        rows = (ctypes.c_float * (k * self.vocab)).from_address(self._logits_at(cache.ctx))
        return np.frombuffer(rows, dtype=np.float32).reshape(k, self.vocab)

    def apply(self, found: Finding) -> None:
        """Take the probe's finding (ggmlprobe.probe, or one kept from an earlier run): the rows a forward may
        carry, and whether steps part from batches or threads from each other."""
        self.found = found
        self.max_rows, self.batch_rows = found.max_rows, found.batch_rows

    def set_threads(self, threads: int) -> None:
        """Compute on `threads` threads from the next forward on, in every open context (the governor's lever), and
        torch's sampler with them (two OpenMP threads beside a busy process wait at every barrier)."""
        self.threads = threads
        torch.set_num_threads(threads)
        for cache in list(self._caches):
            if cache.ctx:
                self.lib.llama_set_n_threads(cache.ctx, threads, threads)

    def close(self) -> None:
        if getattr(self, "handle", None):
            self.take_spare(-1)  # frees it: a context must go before its model
            self.lib.llama_batch_free(self.batch)
            self.lib.llama_model_free(self.handle)
            self.handle = None
