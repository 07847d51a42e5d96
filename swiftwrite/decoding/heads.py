"""TokenSwift multi-token heads: γ small blocks on the frozen model that guess the tokens after the next one.

From the hidden state h_0 of position t (the residual stream before the model's final norm), the heads are
chained, each one a residual step of one square matrix:

    h_i      = h_{i-1} + W_i · RMSNorm(h_{i-1}; a_i)          i = 1..γ, W_i [D, D], no bias, no activation
    logits_i = E_V · RMSNorm(h_i; b_i)                        E_V: the model's LM head, rows of the heads' vocabulary

and head i guesses the token at t + 1 + i (the model's own LM head on h_0 gives t + 1). W_i starts at zero
and b_i at the model's final-norm weight, so untrained heads repeat the model's next-token guess: a
sensible start that training shifts forward.

The heads' vocabulary V is the training data's most frequent tokens (at most 8192): drafting then
multiplies γ rows by a [|V|, D] slice of the LM head instead of the whole [49K, D] matrix (1.4 ms instead of
6.7 ms per step for the default model on a 2-core CPU, where a one-token forward takes ~30 ms), and
training uses the same softmax. Tokens outside V are never drafted by the heads; the other sources still can.

Drafting (*fused*, Medusa-style): verification already computed the hidden state of the last accepted node
p, whose LM-head output is the bonus token at p + 1, the next tree's root. The heads on that state guess
p + 2 .. p + 1 + γ: depths 1..γ of the next tree, so a step stays one forward pass. The tree is the
cartesian product of each head's top-k (3 + 9 + 27 nodes for k = 3), scored by the online acceptance
rates; the engine's budget keeps the best.

Drafting (*two-pass*, the paper's scheme, `--head-mode two-pass`): a separate one-token forward of the root
over the partial draft cache (draftcache.py) first; the model's own LM head on that state guesses depth 1 and
the heads depths 2..γ+1. One level deeper, for an extra forward per step: on a 2-core CPU that forward costs
about as much as the verification it feeds (bench/ measures both modes side by side).

Files are safetensors with string metadata (format, base-model fingerprint, γ, sizes, training data, steps,
held-out accuracy). A file made for another model, another γ or width, or a damaged one, is refused with a
`HeadsError`, a one-line message the CLI shows as a warning before drafting without heads.
"""

from __future__ import annotations

import heapq
import json
import os
import tempfile
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ..base.errors import UserError, first_line
from ..base.paths import home
from ..models.model import LeanModel, linear, rms_norm
from ..tensors.draftcache import PartialCache
from .drafting import AcceptanceStats, DraftSource
from .tree import DraftTree

GAMMA = 3  # heads: tokens t+2 .. t+4 (the paper's γ)
TOP_K = 3  # candidates per head in the draft tree (the paper's top-3)
FORMAT = "swiftwrite-heads"
VERSION = "1"
PACKAGE_DIR = Path(__file__).resolve().parents[1] / "heads"  # heads shipped with the package, one file per model


class HeadsError(UserError):
    """A heads file that cannot be used with this model. The caller warns and drafts without heads."""


class Heads(torch.nn.Module):
    """γ chained heads over a vocabulary `vocab` (sorted token ids). Training updates the parameters; the
    model's LM head stays outside, frozen."""

    def __init__(self, hidden_size: int, vocab: torch.Tensor, gamma: int = GAMMA, eps: float = 1e-6,
                 out_norm: torch.Tensor | None = None):
        super().__init__()
        D = hidden_size
        self.gamma, self.eps = gamma, eps
        self.in_norm = torch.nn.Parameter(torch.ones(gamma, D))
        self.proj = torch.nn.Parameter(torch.zeros(gamma, D, D))
        start = out_norm.detach().float().reshape(1, D) if out_norm is not None else torch.ones(1, D)
        self.out_norm = torch.nn.Parameter(start.repeat(gamma, 1).contiguous())
        self.register_buffer("vocab", vocab.to(torch.long))
        self.meta: dict[str, str] = {}  # what the file said about how the heads were made

    @classmethod
    def fresh(cls, model: LeanModel, vocab: torch.Tensor, gamma: int = GAMMA) -> "Heads":
        """Untrained heads for `model`: each one repeats the model's own next-token guess."""
        return cls(model.cfg.hidden_size, vocab, gamma, model.cfg.rms_eps, model.final_norm.cpu())

    def states(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, D] (before the final norm) -> the normed states [n, γ, D] that meet the LM head."""
        h, out = hidden.to(self.proj.dtype), []
        for i in range(self.gamma):
            h = h + linear(rms_norm(h, self.in_norm[i], self.eps), self.proj[i])
            out.append(rms_norm(h, self.out_norm[i], self.eps))
        return torch.stack(out, dim=1)

    def lm_slice(self, model: LeanModel) -> torch.Tensor:
        """The rows of the model's LM head for the heads' vocabulary, [|V|, D], a copy (frozen)."""
        return model.lm_head.index_select(0, self.vocab.to(model.lm_head.device)).detach().clone()


# ---------------------------------------------------------------------------------------------------------
# Files


def save_heads(heads: Heads, path: Path, meta: dict[str, object]) -> Path:
    """Write `heads` to `path` atomically (temp file in the same directory, fsync, rename): an interrupted
    save never leaves a half-written file. `meta` values become strings (dicts and lists as JSON)."""
    path = Path(path)
    tensors = {
        "in_norm": heads.in_norm.detach().float().contiguous().cpu(),
        "proj": heads.proj.detach().float().contiguous().cpu(),
        "out_norm": heads.out_norm.detach().float().contiguous().cpu(),
        "vocab": heads.vocab.to(torch.int32).contiguous().cpu(),
    }
    strings = {"format": FORMAT, "version": VERSION, "gamma": str(heads.gamma),
               "hidden_size": str(heads.proj.shape[-1]), "rms_eps": repr(heads.eps)}
    for k, v in meta.items():
        strings[k] = v if isinstance(v, str) else json.dumps(v)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as e:
        raise UserError(f"cannot write the heads to {path.parent} ({e.strerror}); choose another --out.") from None
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata=strings)
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes it private; a heads file is as shareable as any output
        os.replace(tmp, path)
    except OSError as e:
        raise UserError(f"cannot write the heads to {path} ({e.strerror}); free space or choose another --out.") from None
    finally:
        Path(tmp).unlink(missing_ok=True)
    return path


def read_metadata(path: Path) -> dict[str, str]:
    """The string metadata of a heads file (header only, no tensor is read). HeadsError if it is not one."""
    path = Path(path)
    if not path.is_file():
        raise HeadsError(f"heads file {path} does not exist.")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = dict(f.metadata() or {})
    except Exception as e:  # safetensors raises its own error types, OSError and ValueError for damage
        raise HeadsError(f"heads file {path} is corrupt or not a safetensors file ({first_line(e, 120)}); "
                         "train new heads with `swiftwrite train-heads`.") from None
    if meta.get("format") != FORMAT:
        raise HeadsError(f"{path} is a safetensors file but not a swiftwrite heads file; "
                         "train heads with `swiftwrite train-heads`.")
    return meta


def load_heads(path: Path, model: LeanModel, fingerprint: str, gamma: int | None = None) -> Heads:
    """Load heads for `model` (whose store fingerprint is `fingerprint`). `gamma`: the number of heads
    asked for (None: whatever the file has). Raises HeadsError, one sentence, for a file made for another
    model, another γ or hidden size, or a damaged file."""
    path = Path(path)
    meta = read_metadata(path)
    retrain = "train heads for it with `swiftwrite train-heads`"
    if meta.get("fingerprint") != fingerprint:
        raise HeadsError(f"heads in {path} were trained for another model (fingerprint {meta.get('fingerprint')}, "
                         f"this model is {fingerprint}); {retrain}.")
    try:
        g, D = int(meta["gamma"]), int(meta["hidden_size"])
        eps = float(meta.get("rms_eps", model.cfg.rms_eps))
    except (KeyError, ValueError):
        raise HeadsError(f"heads file {path} has damaged metadata (gamma, hidden_size); {retrain}.") from None
    if gamma is not None and g != gamma:
        raise HeadsError(f"heads in {path} have γ = {g}, but {gamma} were asked for; {retrain} with that γ.")
    if D != model.cfg.hidden_size:
        raise HeadsError(f"heads in {path} are {D} wide, the model's hidden size is {model.cfg.hidden_size}; {retrain}.")
    try:
        t = load_file(str(path))
    except Exception as e:
        raise HeadsError(f"heads file {path} is corrupt ({first_line(e, 120)}); {retrain}.") from None
    shapes = {"in_norm": (g, D), "proj": (g, D, D), "out_norm": (g, D)}
    for name, shape in shapes.items():
        if name not in t or tuple(t[name].shape) != shape or not torch.isfinite(t[name]).all():
            raise HeadsError(f"heads file {path} is corrupt (tensor {name} missing, misshapen or not finite); {retrain}.")
    vocab = t.get("vocab")
    if vocab is None or vocab.ndim != 1 or vocab.numel() == 0 or int(vocab.min()) < 0 \
            or int(vocab.max()) >= model.cfg.vocab_size or bool((vocab[1:] <= vocab[:-1]).any()):
        raise HeadsError(f"heads file {path} has a vocabulary that does not fit this model's {model.cfg.vocab_size} "
                         f"token ids; {retrain}.")
    heads = Heads(D, vocab, g, eps)
    with torch.no_grad():
        heads.in_norm.copy_(t["in_norm"])
        heads.proj.copy_(t["proj"])
        heads.out_norm.copy_(t["out_norm"])
    heads.requires_grad_(False)
    heads.meta = meta
    return heads.to(model.device, model.dtype)


def user_dir() -> Path:
    """Where `swiftwrite train-heads` writes by default; looked at before the package's own heads."""
    return home() / "heads"


def default_heads_path(fingerprint: str) -> Path | None:
    """The heads file for the model with this fingerprint: the newest one the user trained
    ($SWIFTWRITE_HOME/heads), else the one shipped in the package; None when there is none."""
    def candidates(folder: Path, newest_first: bool):
        files = list(folder.glob("*.safetensors")) if folder.is_dir() else []
        return sorted(files, key=lambda p: p.stat().st_mtime, reverse=True) if newest_first else sorted(files)

    for path in [*candidates(user_dir(), True), *candidates(PACKAGE_DIR, False)]:
        try:
            if read_metadata(path).get("fingerprint") == fingerprint:
                return path
        except (HeadsError, OSError):
            continue  # someone else's file or a damaged one: not ours to complain about here
    return None


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# ---------------------------------------------------------------------------------------------------------
# Drafting


class HeadsDrafter(DraftSource):
    """Fused head drafting: the heads run on the hidden state of the last accepted node (after_accept) and
    their top-k tokens become depths 1..γ of the next tree."""

    name = "heads"
    noise_aware = True  # rank 0 is the sampler's pick (guesses(); two-pass depth 1 processed); False: top-k only (bench/noise_aware.py)
    costly = True  # γ matrix products and an LM-head slice per step (~1.5 ms of a ~20 ms CPU step)

    def __init__(self, source_id: int, stats: AcceptanceStats, heads: Heads, lm: torch.Tensor, top_k: int = TOP_K):
        super().__init__(source_id, stats)
        self.heads, self.lm, self.top_k = heads, lm, min(top_k, lm.shape[0])
        self.vocab = heads.vocab.cpu().numpy()
        self._pending: np.ndarray | None = None  # [γ, k] token ids from the latest verification
        self._guess: np.ndarray | None = None  # the same, once committed: valid for a history of length _at
        self._at = -1

    @classmethod
    def factory(cls, heads: Heads, model: LeanModel, top_k: int = TOP_K):
        """A `make_sources(..., heads=...)` factory: callable(source_id, stats) -> HeadsDrafter."""
        lm = heads.lm_slice(model)  # sliced once, shared by every drafter the factory makes
        return lambda source_id, stats: cls(source_id, stats, heads, lm, top_k)

    sampler = None  # the engine's, once bound: its settings and noise make the drafts pick as it will

    def bind(self, engine) -> None:
        self.sampler = engine.sampler

    @torch.inference_mode()
    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Each head's logits [γ, slice] for the hidden state [D] of one position. All γ heads share one product
        with the (sliced) LM head."""
        z = self.heads.states(hidden.reshape(1, -1))[0]  # [γ, D]
        return linear(z.to(self.lm.dtype), self.lm)  # heads fresh from fit: float32

    @torch.inference_mode()
    def guesses(self, logits: torch.Tensor, first: int) -> np.ndarray:
        """Token ids [γ, k], best first, from head_logits; head j guesses the token at absolute position first + j.
        Greedy: each head's top-k. Sampling (noise-aware): the sampler's choice there is argmax(logits / T + G_p)
        with G_p fixed by (seed, p), known before the tree is built, so rank 0 is the token the sampler picks if
        the head's distribution is right (the penalties left out: a draft needs only to be likely; verification
        keeps the text exact either way), then the head's top-k."""
        top = torch.topk(logits, self.top_k, dim=-1).indices
        sampler = self.sampler
        if self.noise_aware and sampler is not None and not sampler.greedy:
            vocab = self.heads.vocab.to(logits.device)
            noise = torch.stack([sampler.noise(first + j)[vocab] for j in range(logits.shape[0])])
            pick = (logits.float() / sampler.s.temperature + noise).argmax(-1, keepdim=True)
            top = _first_then(pick, top)
        return self.vocab[top.cpu().numpy()]

    def after_accept(self, hidden: torch.Tensor) -> None:
        self._pending = self.head_logits(hidden)

    def after_commit(self, history: np.ndarray, n_new: int) -> None:
        # The guesses are for the tree rooted at the token just committed last (depth d: position len + d - 1);
        # any other history (a fresh start, a resume) has none.
        self._guess = None if self._pending is None else self.guesses(self._pending, len(history))
        self._at, self._pending = len(history), None

    def propose(self, tree: DraftTree, history: np.ndarray, max_depth: int, limit: int) -> None:
        if self._guess is None or len(history) != self._at:
            return
        self._grow(tree, self._guess.tolist(), max_depth, limit)

    def _grow(self, tree: DraftTree, guess: list[list[int]], max_depth: int, limit: int) -> None:
        """guess[d - 1]: candidate tokens for depth d, best first."""
        depth_max = min(max_depth, len(guess))
        # Best-first over the cartesian product: pop the likeliest node, give it the next head's top-k.
        heap, added = [(-tree.score[0], 0)], 0
        while heap and added < limit:
            _, node = heapq.heappop(heap)
            d = tree.depth[node] + 1
            if d > depth_max:
                continue
            for rank, tok in enumerate(guess[d - 1]):
                before = len(tree)
                child = tree.add(node, tok, tree.score[node] * self.stats.estimate(self.id, d, rank), self.id, rank)
                added += len(tree) > before
                heapq.heappush(heap, (-tree.score[child], child))
                if added >= limit:
                    break


class TwoPassHeadsDrafter(HeadsDrafter):
    """The paper's two-pass scheme: before each verification, a one-token draft forward of the root (the
    token just committed) over the partial draft cache (draftcache.py) gives the root's own hidden state.
    The model's LM head on it guesses depth 1, the heads guess depths 2..γ+1: one level deeper than fused
    drafting, for the price of an extra forward that attends to at most `kv_budget` slots."""

    name = "heads"

    def __init__(self, source_id: int, stats: AcceptanceStats, heads: Heads, lm: torch.Tensor, model: LeanModel,
                 kv_budget: int, top_k: int = TOP_K):
        super().__init__(source_id, stats, heads, lm, top_k)
        self.model, self.kv_budget = model, kv_budget
        self.partial = None
        self.engine = None
        self._span = None
        self.draft_forwards = 0

    @classmethod
    def factory(cls, heads: Heads, model: LeanModel, kv_budget: int, top_k: int = TOP_K):
        lm = heads.lm_slice(model)
        return lambda source_id, stats: cls(source_id, stats, heads, lm, model, kv_budget, top_k)

    def bind(self, engine) -> None:
        super().bind(engine)
        self.engine = engine
        self.partial = PartialCache(engine.cache, min(self.kv_budget, engine.window.context))

    def after_accept(self, hidden: torch.Tensor) -> None:
        pass  # the root's state comes from the draft forward instead

    def rewind(self, n: int) -> None:
        self._span = None  # the partial cache holds taken-back tokens: rebuilt at the next proposal

    def after_commit(self, history: np.ndarray, n_new: int) -> None:
        pass

    @torch.inference_mode()
    def propose(self, tree: DraftTree, history: np.ndarray, max_depth: int, limit: int) -> None:
        e = self.engine
        if e.span != self._span:  # the context was rebuilt: new slots, new positions
            self.partial.reset()
            self._span = e.span
        self.partial.sync()
        dev = self.model.device
        ids = torch.tensor([int(history[-1])], device=dev)
        pos = torch.tensor([e.cache.length], device=dev)  # where verification will put the root
        logits, hidden = self.model.forward(ids, pos, None, kv=self.partial.kv)
        self.draft_forwards += 1
        first = torch.topk(logits, self.top_k, dim=-1).indices
        n = len(history)  # the root is history[-1]; depth d is position n + d - 1
        if self.noise_aware:
            # the model's own choice at depth 1 if the partial cache's logits are the full one's, through every
            # processor the sampler applies (penalty and n-gram suppression move greedy's choice too) and, when
            # sampling, the noise of that position: the root's row as verification will compute it
            root = torch.tensor([int(history[-1])], device=dev)
            flat_anc = torch.ones(1, 1, dtype=torch.bool, device=dev)
            zero = torch.zeros(1, dtype=torch.long, device=dev)
            processed = self.sampler.process(logits, e.S[:n], root, zero, flat_anc, torch.full_like(zero, -1))
            first = _first_then(self.sampler.choose(processed, [n]).reshape(1, 1), first)
        guess = [first[0].cpu().tolist(), *self.guesses(self.head_logits(hidden[0]), n + 1).tolist()]
        self._grow(tree, guess, max_depth, limit)


def _first_then(pick: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
    """Rows of `top` [r, k] with `pick` [r, 1] first and the others after it in their order, still k distinct."""
    others = top.masked_fill(top == pick, -1)
    order = torch.argsort((others < 0).to(torch.int8), dim=-1, stable=True)  # the pick's old slot moves last
    return torch.cat([pick, torch.gather(others, 1, order)[:, : top.shape[1] - 1]], dim=1)
