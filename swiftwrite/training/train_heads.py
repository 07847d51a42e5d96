"""Training the multi-token heads (heads.py) on a frozen model: data in, a heads file out.

The backbone never enters autograd. Its hidden states (before the final norm) are computed once for the
whole data set under `torch.inference_mode()` and kept in memory ([tokens, hidden] float32: 50K tokens of
a 576-wide model are 115 MB); every training step then costs only the heads and LM-head products over a
batch of cached positions. That is what makes a useful training run take minutes on a 2-core CPU.

The softmax runs over the heads' vocabulary (heads.py): the data's most frequent tokens, at most `vocab`
of them. That makes a step's LM-head products several times cheaper than over 49K ids, and it is the same
softmax the drafter uses. A target outside that vocabulary is left out of the loss and counted as a miss in
the held-out accuracy.

The loss of head i at position t is, by default, the cross-entropy against the model's own distribution
for the token at t + 1 + i (its LM head at t + i, which the cached hidden states give for free) instead of
the one token the text contains there. On 45K self-distilled tokens that soft target lifted held-out top-1
of head 1 from 11% to 13% and of heads 2-3 from 7.5/6% to 8.5/7.5%, and stopped the overfitting that hard
targets showed after ~300 steps.

Self-distillation (`self_distill=True`) lets the model write its own training text first, from the
long-form prompt templates with the long-form sampling settings: text like what the heads will see.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from ..base.errors import UsageError, UserError
from ..base.hf import transformers
from ..base.options import TRAIN_HEADS, defaults
from ..decoding.heads import GAMMA, Heads, save_heads, user_dir
from ..models.model import load_lean
from ..models.store import fingerprint, home
from ..tensors.ops import linear, rms_norm
from .headdata import choose_vocab, hidden_states, read_texts, targets, token_windows, write_selfdistill

HELD_OUT = 0.1  # every tenth sequence is kept out of training, for the accuracy report
WARMUP = 0.1  # share of the steps spent warming the learning rate up linearly (the paper: 50 of 200 steps)
HIDDEN_BYTES = 2 << 30  # cap on the cached hidden states: 0.9M tokens of a 576-wide model, 130K of a 4096-wide one
ASKED = defaults(TRAIN_HEADS)  # steps, batch, lr, seq_len: `train-heads`' options, declared (and explained) there

# ---------------------------------------------------------------------------------------------------------
# Training


@dataclass
class Split:
    hidden: torch.Tensor  # [m, D]
    tokens: torch.Tensor  # [m, γ] target token ids, -1: none
    index: torch.Tensor  # [m, γ] the targets as rows of the heads' vocabulary, -1: none or outside it


def lr_at(step: int, steps: int, lr: float) -> float:
    """Linear warm-up over the first WARMUP share of the steps, then a cosine down to zero."""
    warm = max(1, int(WARMUP * steps))
    if step < warm:
        return lr * (step + 1) / warm
    return lr * 0.5 * (1 + math.cos(math.pi * (step - warm) / max(1, steps - warm)))


def head_losses(heads: Heads, lm: torch.Tensor, hidden: torch.Tensor, index: torch.Tensor,
                soft: torch.Tensor | None = None, distill: float = 0.0) -> torch.Tensor:
    """Cross-entropy per head [γ] over the heads' vocabulary (targets outside it are ignored). With `soft`
    [m, γ, |V|] (the model's own distribution at each target position), a `distill` share of the loss is the
    cross-entropy against it instead of the one token the text happened to contain."""
    z = heads.states(hidden)  # [m, γ, D]
    logits = (z.reshape(-1, z.shape[-1]) @ lm.t()).view(z.shape[0], heads.gamma, -1)
    hard = torch.stack([F.cross_entropy(logits[:, i], index[:, i], ignore_index=-1) for i in range(heads.gamma)])
    if soft is None or distill == 0:
        return hard
    ok = (index >= 0).float()  # [m, γ]
    ce = -(soft * torch.log_softmax(logits, dim=-1)).sum(-1)  # [m, γ]
    return (1 - distill) * hard + distill * (ce * ok).sum(0) / ok.sum(0).clamp(min=1)


@torch.no_grad()
def model_targets(model, lm: torch.Tensor, hidden: torch.Tensor, pick: torch.Tensor, gamma: int) -> torch.Tensor:
    """The model's own next-token distribution over the heads' vocabulary at the position before each head's
    target: for head i at t, softmax of the LM head at t + i. [m, γ, |V|]; rows past a window's end are junk
    (their hard target is -1, so they carry no weight)."""
    rows = (pick[:, None] + torch.arange(1, gamma + 1)).clamp(max=hidden.shape[0] - 1)  # [m, γ]
    h = rms_norm(hidden[rows.reshape(-1)], model.final_norm.float().cpu(), model.cfg.rms_eps)
    return torch.softmax(h @ lm.t(), dim=-1).view(rows.shape[0], gamma, -1)


@torch.inference_mode()
def evaluate(heads: Heads, lm: torch.Tensor, split: Split, chunk: int = 1024) -> dict:
    """Held-out top-1 / top-3 accuracy per head, over every position with a target (a target outside the
    heads' vocabulary counts as a miss), and the loss on the in-vocabulary ones."""
    vocab = heads.vocab
    hits1 = torch.zeros(heads.gamma)
    hits3 = torch.zeros(heads.gamma)
    nll = torch.zeros(heads.gamma)
    n_in = torch.zeros(heads.gamma)
    valid = (split.tokens >= 0).sum(0).float()
    for a in range(0, split.hidden.shape[0], chunk):
        z = heads.states(split.hidden[a : a + chunk])
        logits = (z.reshape(-1, z.shape[-1]) @ lm.t()).view(z.shape[0], heads.gamma, -1)
        top = vocab[torch.topk(logits, 3, dim=-1).indices]  # [m, γ, 3] token ids
        tgt = split.tokens[a : a + chunk]
        hits1 += (top[..., 0] == tgt).sum(0)
        hits3 += (top == tgt[..., None]).any(-1).sum(0)
        idx = split.index[a : a + chunk]
        lp = torch.log_softmax(logits, dim=-1).gather(-1, idx.clamp(min=0)[..., None])[..., 0]
        nll -= (lp * (idx >= 0)).sum(0)
        n_in += (idx >= 0).sum(0)
    return {
        "top1": [round(float(x), 4) for x in hits1 / valid.clamp(min=1)],
        "top3": [round(float(x), 4) for x in hits3 / valid.clamp(min=1)],
        "loss": [round(float(x), 3) for x in nll / n_in.clamp(min=1)],
        "in_vocab": [round(float(x), 4) for x in n_in / valid.clamp(min=1)],
    }


@torch.inference_mode()
def base_accuracy(model, split: Split, chunk: int = 512) -> dict:
    """The model's own next-token top-1 / top-3 on the held-out positions, over its whole vocabulary: the
    ceiling the heads are compared with."""
    next_tok = torch.full((split.tokens.shape[0],), -1, dtype=torch.long)
    # the token after position t is the target of head 1 at t - 1
    next_tok[1:] = split.tokens[:-1, 0]
    hit1 = hit3 = n = 0
    for a in range(0, split.hidden.shape[0], chunk):
        h = split.hidden[a : a + chunk].to(model.device, model.dtype)
        logits = linear(rms_norm(h, model.final_norm, model.cfg.rms_eps), model.lm_head)
        top = torch.topk(logits, 3, dim=-1).indices.cpu()
        tgt = next_tok[a : a + chunk]
        ok = tgt >= 0
        hit1 += int(((top[:, 0] == tgt) & ok).sum())
        hit3 += int(((top == tgt[:, None]).any(-1) & ok).sum())
        n += int(ok.sum())
    return {"top1": round(hit1 / max(n, 1), 4), "top3": round(hit3 / max(n, 1), 4)}


def fit(model, windows: list[np.ndarray], held: list[np.ndarray], *, gamma: int = GAMMA, steps: int = ASKED["steps"],
        batch: int = ASKED["batch"], lr: float = ASKED["lr"], vocab: int = 8192, distill: float = 1.0, seed: int = 0,
        log=print, progress: bool = False) -> tuple[Heads, dict]:
    """Train γ heads on `windows` (1-D arrays of token ids) and measure them on `held`. Returns the
    heads and a report: held-out accuracy and loss per head, before and after training, and timings."""
    t0 = time.time()
    torch.manual_seed(seed)
    cut = sum(map(len, windows))
    windows = list(windows) + list(held)
    H = hidden_states(model, windows, log)
    T = torch.from_numpy(targets(windows, gamma))
    t_hidden = time.time()
    vocab_ids, train_set, held = _split(H, T, cut, vocab, model.cfg.vocab_size)
    usable = torch.nonzero(train_set.index[:, 0] >= 0)[:, 0]  # positions whose head-1 target is in the vocabulary
    if usable.numel() == 0:
        raise UserError("no training position has a next-but-one token to learn; give more text.")

    heads = Heads.fresh(model, vocab_ids, gamma)
    lm = heads.lm_slice(model).float()
    untrained = evaluate(heads, lm, held)
    log(f"vocabulary: {vocab_ids.numel()} tokens (covering {untrained['in_vocab'][0]:.1%} of held-out targets); "
        f"untrained heads: top-1 {_fmt(untrained['top1'])}, loss {_fmt(untrained['loss'], 2)}")
    ema = _optimize(model, heads, lm, train_set, usable, gamma=gamma, steps=steps, batch=batch, lr=lr,
                    distill=distill, seed=seed, log=log, progress=progress)
    t_train = time.time()
    result = evaluate(heads, lm, held)
    report = {
        "heldout": result,
        "untrained": untrained,
        "base_next_token": base_accuracy(model, held),
        "train_loss": [round(x, 3) for x in ema.tolist()],
        "train_tokens": cut,
        "heldout_tokens": held.tokens.shape[0],
        "vocab_size": vocab_ids.numel(),
        "seconds": {"hidden_states": round(t_hidden - t0, 1), "train": round(t_train - t_hidden, 1)},
    }
    return heads, report


def _split(H: torch.Tensor, T: torch.Tensor, cut: int, vocab: int, vocab_size: int) -> tuple[torch.Tensor, Split, Split]:
    """The heads' vocabulary (at most `vocab` of the training part's most frequent targets), and the training
    (positions before `cut`) and held-out parts with their targets as rows of it."""
    vocab_ids = torch.from_numpy(choose_vocab(T[:cut].numpy(), vocab))
    where = torch.full((vocab_size,), -1, dtype=torch.long)
    where[vocab_ids] = torch.arange(vocab_ids.numel())
    index = torch.where(T >= 0, where[T.clamp(min=0)], T)
    return vocab_ids, Split(H[:cut], T[:cut], index[:cut]), Split(H[cut:], T[cut:], index[cut:])


def _optimize(model, heads: Heads, lm: torch.Tensor, train_set: Split, usable: torch.Tensor, *, gamma: int, steps: int,
              batch: int, lr: float, distill: float, seed: int, log, progress: bool) -> torch.Tensor:
    """`steps` AdamW steps over batches drawn from the `usable` positions; the heads come out frozen. Returns
    the running (EMA) loss per head [γ]."""
    opt = torch.optim.AdamW(heads.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed)
    ema, every = None, max(1, steps // 10)
    bar = _Bar(steps) if progress else None
    try:
        for step in range(steps):
            for g in opt.param_groups:
                g["lr"] = lr_at(step, steps, lr)
            pick = usable[torch.randint(usable.numel(), (batch,), generator=gen)]
            soft = model_targets(model, lm, train_set.hidden, pick, gamma) if distill else None
            losses = head_losses(heads, lm, train_set.hidden[pick], train_set.index[pick], soft, distill)
            opt.zero_grad(set_to_none=True)
            losses.mean().backward()
            opt.step()
            cur = losses.detach()
            ema = cur if ema is None else 0.9 * ema + 0.1 * cur
            if bar is not None:
                bar.update(step + 1, ema.tolist())
            if (step + 1) % every == 0 or step + 1 == steps:
                log(f"step {step + 1}/{steps}: loss per head {_fmt(ema.tolist(), 2)}")
    finally:
        if bar is not None:
            bar.close()
    heads.requires_grad_(False)
    return ema


def default_out(model_name: str) -> Path:
    """Where `train-heads` writes when no --out is given: found automatically by heads.default_heads_path."""
    safe = "".join(c if c.isalnum() or c in "-_." else "-" for c in Path(model_name).name) or "model"
    return user_dir() / f"{safe}.safetensors"


def train(
    model_dir: Path,
    data: Path | None = None,  # a text file or a directory of text files; None with self_distill
    self_distill: bool = False,  # let the model write its training text first (saved to distill_out)
    steps: int = ASKED["steps"],  # optimizer steps
    batch: int = ASKED["batch"],  # positions per step
    lr: float = ASKED["lr"],  # AdamW peak learning rate
    seq_len: int = ASKED["seq_len"],  # longest sequence run through the model
    out: Path | None = None,  # the heads file; None: $SWIFTWRITE_HOME/heads/<model dir name>.safetensors
    log=print,  # progress lines
    *,
    gamma: int = GAMMA,
    vocab: int = 8192,  # the heads' vocabulary: at most this many of the data's most frequent tokens
    distill: float = 1.0,  # share of the loss against the model's own distribution rather than the text's token
    data_note: str = "",  # appended to the data description in the file's metadata
    distill_out: Path | None = None,  # where self-distilled text goes; None: $SWIFTWRITE_HOME/selfdistill.txt
    distill_tokens: int = 1536,  # tokens per self-distilled sample (32 samples)
    seed: int = 0,
    progress: bool = False,  # a Rich progress bar with the loss per head on standard error
) -> dict:
    """Train γ heads on the frozen model in `model_dir`, write them to `out` (atomically) and return the
    report that is also stored in the file's metadata. Bad options raise UsageError, bad data UserError,
    both before anything is written."""

    model_dir = Path(model_dir)
    out = _checked_out(model_dir, data, self_distill, out, steps=steps, batch=batch, lr=lr, seq_len=seq_len,
                       gamma=gamma, vocab=vocab)
    if data is not None:  # the data is checked before anything slow happens
        texts, what = read_texts(Path(data))
    t0 = time.time()
    fp = fingerprint(model_dir)
    model = load_lean(model_dir)
    if self_distill:
        data, texts, what = _self_distill(model_dir, distill_out, distill_tokens, seed, log)
    windows, held = _hold_out(_windows(model_dir, model, texts, seq_len, data, log))
    log(f"data: {what}; {sum(map(len, windows)) + sum(map(len, held))} tokens in sequences of up to {seq_len}, "
        f"{len(windows)} to train on, {len(held)} held out")
    heads, report = fit(model, windows, held, gamma=gamma, steps=steps, batch=batch, lr=lr, vocab=vocab,
                        distill=distill, seed=seed, log=log, progress=progress)
    report["seconds"]["total"] = round(time.time() - t0, 1)
    result, base = report["heldout"], report["base_next_token"]
    meta = {"fingerprint": fp, "model": model_dir.name, "data": what + (f"; {data_note}" if data_note else ""),
            "steps": str(steps), "batch": str(batch), "lr": repr(lr), "seq_len": str(seq_len), "distill": repr(distill),
            "accuracy": {"top1": result["top1"], "top3": result["top3"]}, "heldout_loss": result["loss"],
            "report": report, "created": time.strftime("%Y-%m-%d")}
    save_heads(heads, out, meta)
    log(f"held-out accuracy per head (tokens t+2..t+{gamma + 1}): top-1 {_fmt(result['top1'])}, "
        f"top-3 {_fmt(result['top3'])}; the model's own next token: top-1 {base['top1']:.1%}")
    log(f"wrote {out} in {time.time() - t0:.0f} s")
    report["out"] = str(out)
    return report


def _checked_out(model_dir: Path, data: Path | None, self_distill: bool, out: Path | None, *, steps: int, batch: int,
                 lr: float, seq_len: int, gamma: int, vocab: int) -> Path:
    """The heads file `train` writes, once its options are checked (UsageError, before anything slow)."""
    for name, value, ok in (("--steps", steps, steps >= 1), ("--batch", batch, batch >= 1), ("--lr", lr, 0 < lr < 1),
                            ("--seq-len", seq_len, seq_len >= gamma + 2), ("gamma", gamma, 1 <= gamma <= 8),
                            ("vocab", vocab, vocab >= 3)):
        if not ok:
            raise UsageError(f"{name} = {value} is out of range.")
    if (data is None) == (not self_distill):
        raise UsageError("give either --data FILE|DIR or --self-distill (one of them).")
    out = Path(out) if out is not None else default_out(model_dir.name)
    if out.is_dir():
        raise UsageError(f"--out {out} is a directory; give a file name ending in .safetensors.")
    return out


def _self_distill(model_dir: Path, distill_out: Path | None, distill_tokens: int, seed: int, log) -> tuple:
    """(the file, its texts, their description) of the text the model writes itself to train on."""
    data = Path(distill_out) if distill_out is not None else home() / "selfdistill.txt"
    write_selfdistill(model_dir, data, new_tokens=distill_tokens, seed=seed, log=log)
    texts, _ = read_texts(data)
    what = (f"self-distilled: {len(texts)} samples of {distill_tokens} tokens from the novel/report templates, "
            f"temperature 0.7, min_p 0.1, repetition penalty 1.2")
    return data, texts, what


def _windows(model_dir: Path, model, texts: list[str], seq_len: int, data: Path, log) -> list[np.ndarray]:
    """The texts as token windows of up to `seq_len`, as many as the hidden-state cache (HIDDEN_BYTES) holds."""
    tok = transformers().AutoTokenizer.from_pretrained(str(model_dir))
    windows = token_windows(tok, texts, seq_len, str(data))
    cap = HIDDEN_BYTES // (4 * model.cfg.hidden_size)
    if sum(map(len, windows)) > cap:
        kept = np.cumsum([len(w) for w in windows]) <= cap
        windows = [w for w, k in zip(windows, kept) if k] or windows[:1]
        log(f"using the first {sum(map(len, windows))} tokens: their hidden states fill the {HIDDEN_BYTES >> 30} GB cache")
    return windows


def _hold_out(windows: list[np.ndarray]) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """(to train on, held out): every round(1 / HELD_OUT)-th window is held out, or the last one of fewer."""
    every = round(1 / HELD_OUT)
    is_held = [k % every == every - 1 for k in range(len(windows))] if len(windows) >= every else \
        [k == len(windows) - 1 for k in range(len(windows))]
    return [w for w, h in zip(windows, is_held) if not h], [w for w, h in zip(windows, is_held) if h]


def _fmt(xs, digits=None) -> str:
    return " / ".join(f"{x:.{digits}f}" if digits else f"{x:.1%}" for x in xs)


class _Bar:
    """A Rich progress bar on standard error whose description carries the running loss of each head."""

    def __init__(self, steps: int):
        self.p = Progress(TextColumn("training heads"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.description}"),
                          TimeRemainingColumn(), console=Console(stderr=True), transient=False)
        self.task = self.p.add_task("", total=steps)
        self.p.start()

    def update(self, step: int, losses: list[float]) -> None:
        self.p.update(self.task, completed=step, description="loss " + " / ".join(f"{x:.2f}" for x in losses))

    def close(self) -> None:
        self.p.stop()
