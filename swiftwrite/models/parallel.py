"""Tensor parallelism over torch.distributed: one model split across N processes (gloo on CPUs, NCCL on GPUs).

Megatron-style: each rank holds 1/N of the attention heads (their q/k/v rows, their KV heads and so 1/N of the
KV cache) and 1/N of the MLP's intermediate columns (gate/up rows); the output and down projections are split by
their input columns, each rank computes a partial sum, and one all-reduce per product adds them (the bias is kept
by rank 0 alone, so it is added once). Norms, RoPE, the embedding table and the LM head are replicated: every rank
then holds the same hidden state after each all-reduce and computes the same logits, with no further collective.
A model whose heads, KV heads or intermediate size do not divide by N is refused with a sentence (no replication).

One process decides. The leader (rank 0) runs the engine as in one process: drafting, sampling, the window and
the cache's bookkeeping. Its model is a `Leader`, which sends every forward (ids, positions, mask, committed
length) and every cache operation (a new cache, an accepted path's compaction) to the followers before running
its own share; the followers (`follow`) run the same forwards on their shards and keep their caches in step, and
nothing else. So every rank verifies the same tree, and the decision is the leader's alone.

Exactness: speculative output under N ranks equals plain decoding under N ranks, by the same argument as in one
process (the forward a tree node gets is the one a step gets, up to the row-count rounding of float32 products;
exact.py covers the half dtypes). Against one process the partial sums are added in another order, so the text
agrees only as long as no near-tie meets those last bits (measured in tests/test_parallel.py).

The processes around it (launching, rank 0's plan, the followers' life, how a run ends when a rank does) are
ranks.py's. Each rank reads only its slices of the safetensors files (read_shard). Not under tensor parallelism:
the heads' two-pass draft forward (refused here; writer runs drop heads), quantized weights, the half dtypes'
exact trees (each rank would need its own exact.check, so a half-precision run under --tp decodes without drafts).
"""

from __future__ import annotations

import re
from dataclasses import replace

import torch
import torch.distributed as dist
from safetensors import SafetensorError, safe_open

from ..base.errors import RankLost, UserError
from ..tensors.weightfiles import safetensors_files
from .forward import Abilities
from .model import KVCache, LeanModel, ModelConfig, read_hf_config

# what the leader sends, as the first word of a header
FORWARD, NEW_CACHE, COMPACT, STOP = range(4)
HEADER = 5  # op, cache id, n (tokens, kept slots or capacity), committed length or compaction start, mask columns


def check_divides(cfg: ModelConfig, world: int) -> None:
    """One sentence when `cfg` cannot be split over `world` ranks."""
    for what, count in (("attention heads", cfg.n_heads), ("KV heads", cfg.n_kv_heads),
                        ("MLP columns", cfg.intermediate_size)):
        if count % world:
            raise UserError(f"the model's {count} {what} do not divide by {world} ranks; use a tensor-parallel "
                            f"degree that divides {cfg.n_heads} query heads, {cfg.n_kv_heads} KV heads and "
                            f"{cfg.intermediate_size} MLP columns.")


def _cut(cfg: ModelConfig, name: str, rank: int, world: int) -> tuple[int, int, int] | str | None:
    """How rank `rank` of `world` takes the weight `name`: (dim, start, stop) for its slice along dim 0 (the rows
    of a column-parallel product) or dim 1 (the input columns of a row-parallel one), "all" for a replicated
    weight, None for one it does not hold (a row-parallel product's bias, which rank 0 alone adds)."""
    H, KV, D, inter = cfg.n_heads // world, cfg.n_kv_heads // world, cfg.head_dim, cfg.intermediate_size // world
    rows = {"q_proj": H * D, "k_proj": KV * D, "v_proj": KV * D, "gate_proj": inter, "up_proj": inter}
    cols = {"o_proj": H * D, "down_proj": inter}
    kind = name.split(".")[-2] if name.count(".") >= 2 else ""
    if kind in rows:  # column-parallel: this rank's output rows (and their bias)
        return 0, rank * rows[kind], (rank + 1) * rows[kind]
    if kind in cols and name.endswith(".weight"):  # row-parallel: this rank's input columns
        return 1, rank * cols[kind], (rank + 1) * cols[kind]
    if kind in cols:  # a row-parallel product's bias: added once, by rank 0, before the sum
        return "all" if rank == 0 else None
    return "all"  # norms, the embedding table, the LM head: replicated


def local_config(cfg: ModelConfig, world: int) -> ModelConfig:
    """One rank's shapes: 1/world of the heads, KV heads and MLP columns."""
    check_divides(cfg, world)
    return replace(cfg, n_heads=cfg.n_heads // world, n_kv_heads=cfg.n_kv_heads // world,
                   intermediate_size=cfg.intermediate_size // world)


def shard(cfg: ModelConfig, weights: dict[str, torch.Tensor], rank: int, world: int) -> tuple[ModelConfig, dict]:
    """This rank's configuration and weights, cut from the whole model's (held in memory), under the names the
    lean forward reads."""
    local = local_config(cfg, world)
    out = {}
    for name, t in weights.items():
        how = _cut(cfg, name, rank, world)
        if how == "all":
            out[name] = t
        elif how is not None:
            dim, a, b = how
            out[name] = (t[a:b] if dim == 0 else t[:, a:b]).contiguous()
    return local, out


def read_shard(model_dir, cfg: ModelConfig, rank: int, world: int) -> dict[str, torch.Tensor]:
    """This rank's weights read from a safetensors directory slice by slice: the rows and columns of the split
    products that are its own, and nothing of the others' (a rank's memory never holds the whole model)."""
    files = safetensors_files(model_dir)
    out: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as fh:
                names = list(fh.keys())
            for name in names:
                how = _cut(cfg, name, rank, world)
                if how is None:
                    continue
                # opened per tensor: the pages of the file a read touches stay mapped (and resident) until the file
                # is closed, and a column slice touches every page of its weight, so one open for the whole file
                # would hold most of the checkpoint at the end of the read
                with safe_open(str(f), framework="pt") as fh:
                    if how == "all":
                        t = fh.get_tensor(name)
                    else:
                        dim, a, b = how
                        piece = fh.get_slice(name)
                        t = piece[a:b] if dim == 0 else piece[:, a:b]
                    # a copy of its own: a tensor left on the file's mapping would keep its pages resident
                    out[name] = t.clone(memory_format=torch.contiguous_format)
        except (SafetensorError, OSError, ValueError) as e:
            raise UserError(f"{f} is corrupt or truncated ({e}); delete it and fetch the model again.") from None
    return out


def _collective(fn, *args, **kw):
    try:
        return fn(*args, **kw)
    except RuntimeError as e:  # gloo: "Connection closed by peer", "Connection reset by peer", timeouts
        raise RankLost(_said(e)) from None


def _said(e: BaseException) -> str:
    """What a failed collective says, without the source path in front and the advice behind
    ("[.../pair.cc:537] Read error [127.0.0.1]:5292: Connection reset by peer. This is typically ..." ->
    "connection reset by peer")."""
    text = " ".join(str(e).split())
    text = re.split(r"\. This is typically", text)[0]
    text = re.sub(r"^\[[^\]]*\]\s*", "", text)
    tail = re.search(r"(connection (?:closed|reset) by peer|timed? ?out[^.]*)", text, re.I)
    return (tail.group(1) if tail else text[:200]).lower() or type(e).__name__


class ShardedModel(LeanModel):
    """A LeanModel over one rank's shard: its row-split products end in an all-reduce. `weights`: the whole
    model's (cut here), or with `local=True` this rank's already (read_shard)."""

    def __init__(self, cfg: ModelConfig, weights: dict, rank: int, world: int, group=None, local: bool = False, **kw):
        if local:
            mine, shapes = weights, local_config(cfg, world)
        else:
            shapes, mine = shard(cfg, weights, rank, world)
        super().__init__(shapes, mine, **kw)
        self.full_cfg, self.rank, self.world, self.group = cfg, rank, world, group

    def reduce(self, y: torch.Tensor) -> torch.Tensor:
        # contiguous: the float32 CPU product of one row is a transposed view (model.linear), and the collective
        # sums a buffer, not a view's strides
        y = y.contiguous()
        _collective(dist.all_reduce, y, group=self.group)
        return y


class _LeaderCache(KVCache):
    """The leader's cache: its compactions are sent to the followers, which mirror them on their own caches."""

    def __init__(self, leader: "Leader", ident: int, cfg, capacity, device, dtype):
        super().__init__(cfg, capacity, device, dtype)
        self.leader, self.ident = leader, ident

    def compact(self, start: int, keep: torch.Tensor) -> None:
        self.leader._send(COMPACT, self.ident, keep.numel(), start)
        self.leader._tensor(keep)
        super().compact(start, keep)


class Leader:
    """Rank 0's model: the engine's interface (forward, new_cache, cfg ...), each call sent to the followers first."""

    def __init__(self, model: ShardedModel):
        if model.rank != 0:
            raise ValueError("only rank 0 leads")
        self.model = model
        self._caches = 0

    def __getattr__(self, name):  # device, dtype, lm_head, embed ...: the shard's
        if name == "model":
            raise AttributeError(name)
        return getattr(self.model, name)

    @property
    def abilities(self) -> Abilities:
        # the shard's, but no thread governor: every rank keeps its fixed share of the cores (a count that changed
        # on one rank would stall the others at each all-reduce)
        return replace(self.model.abilities, governed=False)

    @property
    def cfg(self) -> ModelConfig:
        return self.model.full_cfg  # what the sources and samplers see: the whole model's vocabulary and shapes

    def _send(self, op: int, ident: int = 0, n: int = 0, length: int = 0, mask_cols: int = 0):
        self._tensor(torch.tensor([op, ident, n, length, mask_cols]))

    def _tensor(self, t: torch.Tensor) -> None:
        """Send `t` to the followers as int64 on the model's device (NCCL moves CUDA tensors only, gloo CPU ones)."""
        _collective(dist.broadcast, t.to(self.model.device, torch.int64).contiguous(), 0, group=self.model.group)

    def new_cache(self, capacity: int) -> KVCache:
        self._caches += 1
        self._send(NEW_CACHE, self._caches, capacity)
        m = self.model
        return _LeaderCache(self, self._caches, m.cfg, capacity, m.device, m.dtype)

    def forward(self, ids, positions, cache, mask=None, logits_for=None, kv=None):
        if kv is not None:
            raise ValueError("draft forwards over a partial cache (the heads' two-pass mode) are not tensor-parallel")
        n = ids.shape[0]
        cols = 0 if mask is None else mask.shape[1]
        self._send(FORWARD, cache.ident, n, cache.length, cols)
        self._tensor(ids)
        self._tensor(positions)
        if mask is not None:
            self._tensor(mask)
        return self.model.forward(ids, positions, cache, mask, logits_for)

    def stop(self) -> None:
        """Release the followers: their `follow` returns."""
        self._send(STOP)


def load_sharded(model_dir, rank: int, world: int, group=None, device="cpu", dtype=torch.float32,
                 attention: str = "auto") -> ShardedModel:
    """This rank's shard of a safetensors model directory, read slice by slice (read_shard)."""
    cfg = ModelConfig.from_hf(read_hf_config(model_dir))
    check_divides(cfg, world)
    try:
        return ShardedModel(cfg, read_shard(model_dir, cfg, rank, world), rank, world, group, local=True,
                            device=device, dtype=dtype, attention=attention)
    except KeyError as e:
        raise UserError(f"{model_dir} lacks the weight {e}; the checkpoint is incomplete or not {cfg.arch}.") from None


def follow(model: ShardedModel) -> int:
    """A follower's whole life: run what the leader sends until it stops. Returns the forwards run."""
    caches: dict[int, KVCache] = {}
    forwards = 0
    none = slice(0, 0)  # a follower needs no logits: the leader samples

    def receive(*shape: int) -> torch.Tensor:
        t = torch.empty(*shape, dtype=torch.int64, device=model.device)
        _collective(dist.broadcast, t, 0, group=model.group)
        return t

    while True:
        op, ident, n, length, cols = receive(HEADER).tolist()
        if op == STOP:
            return forwards
        if op == NEW_CACHE:
            caches[ident] = model.new_cache(n)
        elif op == COMPACT:
            caches[ident].compact(length, receive(n))
        elif op == FORWARD:
            ids, pos = receive(n), receive(n)
            mask = receive(n, cols).bool() if cols else None
            cache = caches[ident]
            cache.length = length
            model.forward(ids, pos, cache, mask, logits_for=none)
            forwards += 1
        else:
            raise RuntimeError(f"unknown tensor-parallel operation {op}")
