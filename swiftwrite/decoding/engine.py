"""The generation engine: token ids in, token ids and step statistics out.

Each step verifies one draft tree (just the root for plain decoding) in one forward pass and commits the
accepted path plus the model's bonus token. The engine knows nothing of text, files or terminals; the
session (run/session.py) subscribes to the `Step`s it yields.

State between steps: `S` (every token so far, prompt included) and a KV cache holding the context of
`window.Window` minus its last token, the root of the next tree.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from ..models.forward import Forward
from .autobudget import AutoBudget
from .bans import Bans
from .budget import MAX_BUDGET, CostCurve
from .drafting import MAX_DEPTH, AcceptanceStats, DraftSource
from .ngram import NgramDrafter
from .recycling import RecyclingDrafter
from .sampling import Sampler
from .tree import DraftTree, Flat, walk
from .window import Window

SOURCES = ("recycling", "ngram", "heads")
PREFILL_CHUNK = 256
TOPK = 8  # next-token candidates per node handed to the sources


@dataclass
class Step:
    tokens: list[int]  # newly committed: accepted draft tokens, then the bonus token (cut at the target)
    forward_tokens: int  # tokens in this step's forward pass (tree size incl. root)
    drafted: int  # draft nodes verified
    accepted_sources: list[int] = field(default_factory=list)  # source bitmask per accepted draft token
    rebuilt: bool = False  # the context window was rebuilt before this step
    forced: bool = False  # committed without sampling (an outline's heading, Engine.force): no forward counted
    backtracks: int = 0  # banned phrases: times this step went back to where one began (bans.py)
    let_through: int = 0  # banned phrases kept after bans.MAX_RETRIES exclusions at their start


def make_sources(names: list[str], vocab: int, static_tree: bool = False, heads=None) -> tuple[list[DraftSource], AcceptanceStats]:
    """`heads`: a ready DraftSource factory for "heads", callable(source_id, stats) (see heads.py)."""
    stats = AcceptanceStats(len(SOURCES))
    out: list[DraftSource] = []
    for name in names:
        if name == "heads":
            if heads is None:
                raise ValueError("the heads source needs trained heads")
            out.append(heads(SOURCES.index(name), stats))
        elif name == "recycling":
            out.append(RecyclingDrafter(SOURCES.index(name), stats, vocab, static_tree=static_tree))
        elif name == "ngram":
            out.append(NgramDrafter(SOURCES.index(name), stats))
        else:
            raise ValueError(f"unknown draft source {name}")
    return out, stats


class Engine:
    def __init__(
        self,
        model: Forward,
        sampler: Sampler,
        window: Window,
        sources: list[DraftSource] = (),
        stats: AcceptanceStats | None = None,
        budget: int | None = None,  # draft nodes per step; None = chosen per step from `cost` (autobudget.py)
        cost: CostCurve | None = None,
        capacity: int = 0,  # tokens S will hold (prompt + target); the buffer is sized once
        stop_ids: tuple[int, ...] = (),  # end the run when one of these is committed (--stop-at-eos)
        cost_at=None,  # callable(cache) -> CostCurve for the cache's context; refreshed as the context grows
        bans: Bans | None = None,  # banned phrases (bans.py); None = none, and no work per step
    ):
        self.model = model
        self.sampler = sampler
        self.window = window
        self.sources = list(sources)
        self.stats = stats
        self.budget = budget
        # the automatic budget (autobudget.py), there when the sources draft and no budget is fixed
        self.auto = AutoBudget(stats, self.sources, cost, cost_at) if budget is None and self.sources else None
        self.stop_ids = set(stop_ids)
        self.bans = bans
        self.final = 0  # with bans: tokens before it are final; the ones after may still be taken back
        rows = model.abilities.max_rows  # the most a forward computes exactly (llama.cpp: its probe's)
        most = min(MAX_BUDGET, rows - 1) if rows is not None else MAX_BUDGET
        max_nodes = 1 + (min(budget, most) if budget is not None else most) if self.sources else 1
        self.max_nodes = max_nodes
        self.cache = model.new_cache(window.context + max_nodes)
        self.S = torch.zeros(max(capacity, window.context + 1), dtype=torch.long)
        self.n = 0
        self.span = (0, 0)  # (s, b) of the context currently in the cache
        self.tree = DraftTree(chain=model.abilities.chains_only)
        self.forwards = 0
        self.stopped = False
        self.pinned = None  # pin_context(): ids kept between the prompt and the recent tokens after a rebuild
        self.prompt_len = window.prompt
        for src in self.sources:
            src.bind(self)

    def pin_context(self, prompt_len: int, pinned) -> None:
        """After a rebuild the context becomes S[:prompt_len] + pinned(r) + S[s:n], r the output index where
        that span's rebuild fell (s + window.recent − prompt_len): a function of the span, not of n, so a resume inside the
        span rebuilds the context the running engine had. The window must reserve room for the longest pin
        (window.prompt = prompt_len + its length). An outline pins the current section's heading and notes; the
        run's notes (run/memory.py) its memory, the names the text established and the lore its kept text names."""
        self.prompt_len, self.pinned = prompt_len, pinned

    # -- context --------------------------------------------------------------------------------------

    def _ensure_capacity(self, n: int) -> None:
        if n > self.S.shape[0]:
            grown = torch.zeros(max(n, 2 * self.S.shape[0]), dtype=torch.long)
            grown[: self.n] = self.S[: self.n]
            self.S = grown

    @torch.inference_mode()
    def start(self, history: list[int], saved=()) -> None:
        """Take the committed sequence (prompt, or prompt + output on resume) and fill the cache. `saved`: stretches
        of cells a running engine saved (start, end, context_key(end), save_cells' bytes), in order: put back where
        they fit this context (abilities.saves_cells), so only the rest is computed."""
        self._ensure_capacity(len(history) + 1)
        self.S[: len(history)] = torch.tensor(history, dtype=torch.long)
        self.n = len(history)
        self.final = self.n
        if self.bans is not None:
            self.bans.reset(self.n, history)
        self._rebuild(seed_sources=True, saved=saved)
        hist = self.S[: self.n].numpy()
        for src in self.sources:
            src.after_commit(hist, self.n)

    def _context_ids(self) -> torch.Tensor:
        s, _ = self.window.span(self.n)
        P = self.window.prompt
        if s == P:
            return self.S[: self.n]
        if self.pinned is None:
            return torch.cat([self.S[:P], self.S[s : self.n]])
        pin = torch.tensor(self.pinned(s + self.window.recent - self.prompt_len), dtype=torch.long)
        return torch.cat([self.S[: self.prompt_len], pin, self.S[s : self.n]])

    def context_key(self, end: int) -> str:
        """A digest of what the first `end` cells are computed from: the context's ids before them."""
        return hashlib.sha256(self._context_ids()[:end].numpy().astype(np.int64).tobytes()).hexdigest()[:32]

    def _rebuild(self, seed_sources: bool = False, saved=()) -> None:
        """Prefill the cache with the current context, all but its last token (the next root).

        Where the model's single steps compute other bits than its batches (`steps_apart`: llama.cpp with several
        threads, ggmlmodel), the tokens a running engine wrote a step at a time since this span's rebuild are
        written a step at a time here too, so a resume (or a restart anywhere in the span) holds the bits the
        running engine held. The span's rebuild fell at n0 (the run's start in the first span), and drafting is off
        there, so one step commits one token: the last n - n0 tokens of the body were single steps."""
        ctx = self._context_ids()
        self.span = self.window.span(self.n)
        self.cache.length = 0
        body = ctx[:-1]
        seed = seed_sources and any(isinstance(s, RecyclingDrafter) for s in self.sources)
        singles = 0
        if self.model.abilities.steps_apart:
            s, _ = self.span
            n0 = self.prompt_len if s == self.window.prompt else s + self.window.recent
            singles = max(0, min(self.n - n0, body.shape[0]))
        batched, done = body.shape[0] - singles, 0
        for start, end, key, blob in saved:  # the first stretch that does not fit ends the loading
            if start != done or end > body.shape[0] or key != self.context_key(end) or \
                    not self.cache.load_cells(blob, start, end):
                break
            done = end
        self.restored = done  # cells put back rather than computed
        bounds = [(a, min(a + PREFILL_CHUNK, batched)) for a in range(done, batched, PREFILL_CHUNK)]
        bounds += [(a, a + 1) for a in range(max(done, batched), body.shape[0])]
        for a, z in bounds:
            chunk = body[a:z].to(self.model.device)
            pos = torch.arange(a, z, device=self.model.device)
            logits, _ = self.model.forward(chunk, pos, self.cache, logits_for=None if seed else slice(-1, None))
            self.cache.length += chunk.shape[0]
            if seed:
                top = torch.topk(logits, TOPK, dim=-1).indices.cpu().numpy().astype(np.int32)
                for src in self.sources:
                    src.seed(chunk.cpu().numpy(), top)

    # -- one step: draft, verify, choose what to commit, commit, tell the sources -----------------------

    @torch.inference_mode()
    def step(self, remaining: int, ends: frozenset | None = None, last: bool = True) -> Step:
        """Verify one tree and commit at most `remaining` tokens; with `ends`, stop committing after the first
        token in it (an outline's section can end there): a plain step would have stopped at that token too.
        `last`: the run ends after `remaining` tokens (not so where an outline's section caps the step)."""
        rebuilt = self.n >= self.span[1]
        if rebuilt:
            self._rebuild()
        t0 = time.perf_counter()
        max_depth = min(self.span[1] - 1 - self.n, remaining - 1, MAX_DEPTH)
        flat, quiet = self._draft(max_depth)
        base = self.cache.length  # position of the root: the context length minus one
        processed, hidden, path, bonus = self._verify(flat)
        new, back, let = self._choose(flat, path, bonus, remaining, ends, last)
        # The cache keeps the root and every committed token but the last (the next root): the accepted path
        # cut to len(new) when the step was cut short, so the next step starts from exactly what was committed.
        self.cache.compact(base, torch.tensor(path[: len(new)], device=self.model.device))
        if self.sources:
            self._learn(flat, path, len(new), processed, hidden, quiet)
        self._commit(new)
        if self.auto is not None and not rebuilt:
            self.auto.timed(flat.tokens.shape[0], time.perf_counter() - t0)
        return self._result(flat, path, new, rebuilt, back, let, remaining, last)

    def _draft(self, max_depth: int) -> tuple[Flat, bool]:
        """The tree to verify, rooted at the last committed token, and whether this is a quiet resting step."""
        tree = self.tree
        tree.reset(int(self.S[self.n - 1]))
        budget, quiet = self._propose(tree, max_depth) if self.sources and max_depth > 0 else (0, False)
        return tree.select(budget, max_depth, device=self.model.device), quiet

    def _propose(self, tree: DraftTree, max_depth: int) -> tuple[int, bool]:
        """Let the sources propose into `tree`; return how many of its nodes to verify, and whether this is a
        quiet resting step (no proposals, and no source learns from its forward: see autobudget.CHECK_EVERY)."""
        auto = self.auto
        if auto is not None and auto.quiet():
            return 0, True
        resting = auto is not None and auto.resting()
        hist = self.S[: self.n].numpy()
        limit = self.max_nodes - 1
        for src in self.sources:
            if not (resting and src.costly):
                src.propose(tree, hist, max_depth, limit)
        if auto is None:
            return min(self.budget, limit), False
        return auto.choose(tree, max_depth, limit, self.n, self.cache), False

    def _verify(self, flat: Flat) -> tuple[torch.Tensor, torch.Tensor, list[int], int]:
        """One forward over the tree: (the processed logits, the hidden states, the accepted path, the bonus)."""
        anc = flat.anc if flat.tokens.shape[0] > 1 else None
        logits, hidden = self.model.forward(flat.tokens, self.cache.length + flat.depth, self.cache, anc)
        self.forwards += 1
        # the root's row decides position n: the tokens banned there (only positions <= n have any)
        excluded = self.bans.excluded(self.n) if self.bans is not None else None
        processed = self.sampler.process(logits, self.S[: self.n], flat.tokens, flat.depth, flat.anc, flat.parent,
                                         excluded)
        choice = self.sampler.choose(processed, [self.n + d for d in flat.depth.tolist()]).tolist()
        path, bonus = walk(flat, choice)
        return processed, hidden, path, bonus

    def _choose(self, flat: Flat, path: list[int], bonus: int, remaining: int, ends: frozenset | None,
                last: bool) -> tuple[list[int], int | None, int]:
        """The tokens to commit: the accepted path's and the bonus, cut at `remaining`, after the first of `ends`,
        after a stop token, and with bans after a banned phrase's end. Also the position to go back to (where that
        phrase began; None: none) and the phrases let through."""
        tok_list = flat.tokens.tolist()
        new = [tok_list[i] for i in path[1:]] + [bonus]
        new = new[:remaining]
        if ends:
            for j, t in enumerate(new):
                if t in ends:
                    new = new[: j + 1]
                    break
        for j, t in enumerate(new):
            if t in self.stop_ids:
                new = new[: j + 1]
                self.stopped = True
                break
        if self.bans is None:
            return new, None, 0
        let, back = self.bans.let_through, None
        for j, t in enumerate(new):
            back = self.bans.push(self.n + j, t)
            if back is not None:
                new = new[: j + 1]
                self.stopped = False  # a stop token after the phrase's end was never reached
                break
        if back is None and ((last and len(new) == remaining) or self.stopped):  # the run ends here
            back = self.bans.finish()  # the text's end completes a pattern ending in \b: as the next byte would
            self.stopped = self.stopped and back is None
        return new, back, self.bans.let_through - let

    def _learn(self, flat: Flat, path: list[int], kept: int, processed: torch.Tensor, hidden: torch.Tensor,
               quiet: bool) -> None:
        """Tell the rates, the automatic budget and the sources what verification found (`kept` of the path's
        tokens are committed)."""
        if flat.tokens.shape[0] > 1:
            self.stats.update(flat, path)
            if self.auto is not None:
                self.auto.verified(len(path) - 1)
        if not quiet:  # a top-k over the whole vocabulary: quiet steps skip it
            top = torch.topk(processed, TOPK, dim=-1).indices.cpu().numpy().astype(np.int32)
            for src in self.sources:
                src.after_verify(flat, top)
        # the costly sources sit out the next step while the budget rests: skip their work for it
        resting = self.auto is not None and self.auto.resting()
        for src in self.sources:
            if not (resting and src.costly):
                src.after_accept(hidden[path[kept - 1]])

    def _commit(self, new: list[int]) -> None:
        """Append `new` to S; tell the sources, and count the shadow checks those tokens decide."""
        self._ensure_capacity(self.n + len(new))
        self.S.numpy()[self.n : self.n + len(new)] = new  # numpy's assignment: a fraction of torch's per-call cost
        self.n += len(new)
        if self.sources:
            hist = self.S[: self.n].numpy()
            for src in self.sources:
                src.after_commit(hist, len(new))
            if self.auto is not None:
                self.auto.check_shadows(hist, self.n)

    def _result(self, flat: Flat, path: list[int], new: list[int], rebuilt: bool, back: int | None, let: int,
                remaining: int, last: bool) -> Step:
        """The step as the writer sees it; with bans, after going `back` and with the tokens settled as final."""
        n_nodes = flat.tokens.shape[0]
        accepted_src = [flat.sources[i] for i in path[1 : len(new) + 1]]  # drafts among the committed tokens
        if self.bans is None:
            return Step(new, n_nodes, n_nodes - 1, accepted_src, rebuilt)
        if back is not None:
            self._back(back)
        # the end of the run (the target, a stop token): what is written is the text, a phrase under way is none
        end = back is None and ((last and len(new) == remaining) or self.stopped)
        old = self.final
        final = self.bans.settle(self.n, everything=end)
        self.final = final
        return Step(self.S[old:final].tolist(), n_nodes, n_nodes - 1, accepted_src, rebuilt,
                    backtracks=int(back is not None), let_through=let)

    def _back(self, s: int) -> None:
        """Go back to position s (a banned phrase began there) and exclude its token there: as plain decoding would
        stand had it never chosen that token. The cache drops the tokens from s on (all but the new root S[s - 1]);
        when s lies before the context's last rebuild, the context is rebuilt for s, as a resume at s would."""
        self.bans.back(s, int(self.S[s]))
        drop = self.n - s
        self.n = s
        if self.auto is not None:
            self.auto.forget()  # their tokens were taken back
        if self.window.span(s) != self.span or self.cache.length - drop < 0:
            self._rebuild()
        else:
            self.cache.length -= drop
        for src in self.sources:
            src.rewind(s)

    def end_text(self) -> Step:
        """With bans, the text ends here for now (an outline's heading follows, the prompt's equal: not checked): a
        pattern that waits on the next character (one ending in \\b) is complete, so decoding goes back to where
        it began; else every token is final. The step returned holds no forward and the tokens made final."""
        let = self.bans.let_through
        back = self.bans.finish()
        if back is not None:
            self._back(back)
        old = self.final
        self.final = self.bans.settle(self.n, everything=back is None)
        return Step(self.S[old : self.final].tolist(), 0, 0, [], backtracks=int(back is not None),
                    let_through=self.bans.let_through - let)

    @torch.inference_mode()
    def force(self, ids: list[int]) -> None:
        """Commit `ids` without sampling (an outline's heading), as prompt tokens are: the sampler's history, the
        drafters and the loop alarm see them like any committed token, in plain and speculative runs alike. The
        cache takes the old root and all new ids but the last (the next root); when that reaches the next
        rebuild, the next step rebuilds the context at the new length instead, as a resume there would."""
        if not ids:
            return
        if self.auto is not None:
            self.auto.forget()  # forced tokens are not the model's choices: they say nothing of a draft
        self._ensure_capacity(self.n + len(ids))
        old = self.n
        self.S[old : old + len(ids)] = torch.tensor(ids, dtype=torch.long)
        self.n += len(ids)
        if self.n < self.span[1]:
            body = self.S[old - 1 : self.n - 1]
            size = 1 if self.model.abilities.steps_apart else PREFILL_CHUNK  # as _rebuild will redo them
            for a in range(0, body.shape[0], size):
                chunk = body[a : a + size].to(self.model.device)
                pos = torch.arange(self.cache.length, self.cache.length + chunk.shape[0], device=self.model.device)
                self.model.forward(chunk, pos, self.cache, logits_for=slice(-1, None))
                self.cache.length += chunk.shape[0]
        if self.sources:
            hist = self.S[: self.n].numpy()
            for src in self.sources:
                src.after_commit(hist, len(ids))
        if self.bans is not None:  # after end_text(): the bans start again past the forced ids, as past a prompt
            self.final = self.n
            self.bans.reset(self.n, self.S[: self.n].numpy())

    def run(self, n_new: int):
        """Yield steps until `n_new` more tokens are committed (or a stop token is)."""
        target = self.n + n_new
        while self.n < target and not self.stopped:
            yield self.step(target - self.n)

    # -- drafter state (speed only: the text never depends on it) -----------------------------------------

    def drafter_state(self) -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray] = {}
        for src in self.sources:
            out.update(src.state())
        return out

    def load_drafter_state(self, state: dict[str, np.ndarray]) -> list[str]:
        warnings = []
        for src in self.sources:
            try:
                src.load_state(state)
            except (ValueError, KeyError, TypeError) as e:
                warnings.append(f"ignored the saved {src.name} state ({e}); drafting restarts cold, the text is unaffected")
        return warnings
