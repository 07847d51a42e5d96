"""Training data for the multi-token heads: the model's own text (self-distillation), text files cut into
token windows, the frozen model's hidden states over them, and the heads' vocabulary.

train_heads.py fits the heads on what this module prepares.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from ..base.errors import UserError
from ..base.hf import transformers
from ..decoding.heads import _umask
from ..io.prompt import apply_template, prompt_ids
from ..tensors.weightfiles import keep_float_copy

PREFILL_CHUNK = 256  # tokens per forward for the hidden states: 1.5x faster than whole 1.5K windows on a CPU
MAX_DATA_BYTES = 16 << 20  # text read at most (about 4M tokens)

# ---------------------------------------------------------------------------------------------------------
# Self-distillation: the model writes its own training text

# Briefs for the long-form templates. Ordered so that the held-out tail (the last ~10% of sequences) is
# a novel and a report whose briefs were never trained on.
BRIEFS = [
    ("novel", "A lighthouse keeper on a remote northern island finds a stranger washed ashore after a storm, and "
              "over one winter the two of them uncover why the light has been failing."),
    ("report", "The state of public libraries in mid-sized cities: funding, usage since 2010, digital lending and "
               "what libraries could become in the next decade."),
    ("novel", "Two sisters inherit their grandmother's failing vineyard in the hills and must decide, over one "
              "harvest, whether to sell it to a developer or save it."),
    ("novel", "A young cartographer in a desert empire is sent to map a city that does not appear on any older "
              "map, and finds that its people remember her."),
    ("report", "Urban heat islands: causes, measured temperature differences, health effects on older residents, "
               "and the cost and benefit of trees, cool roofs and water."),
    ("novel", "A retired detective in a seaside town is asked by a teenage girl to find her missing brother, and "
              "the case leads back to his own last unsolved investigation."),
    ("novel", "On a generation ship two hundred years from Earth, the ship's gardener discovers that the crops are "
              "dying for a reason the council is hiding."),
    ("report", "Small farms and climate change: drought, soil health, crop insurance and the practices that have "
               "kept family farms profitable in dry years."),
    ("novel", "A travelling musician in the 1920s arrives in a mining town on the night of a disaster and stays to "
              "help, falling in with the union organiser and the mine owner's son."),
    ("novel", "A chef who has lost her sense of taste after an illness opens a tiny restaurant anyway, and cooks "
              "from the memories of her customers."),
    ("report", "Remote work five years on: productivity evidence, office vacancy, effects on junior employees and "
               "on city centres, and policies that worked."),
    ("novel", "A boy raised by his grandfather on a canal barge sets out alone to deliver a letter his grandfather "
              "never sent, across a country at war."),
    ("novel", "In a mountain village cut off by snow, the schoolteacher keeps a diary of the winter in which every "
              "household has a secret and a wolf is seen at the church."),
    ("report", "Plastic waste in rivers and oceans: sources, how much is recycled, the economics of deposit schemes, "
               "and which bans reduced litter."),
    ("novel", "An archivist restoring a water-damaged ship's log finds entries describing a voyage that history "
              "says never happened, and follows them to a living descendant."),
    ("report", "Sleep and teenagers: school start times, screens, measured effects on grades and mood, and what "
               "schools that changed their schedule found."),
]

DISTILL_SAMPLING = dict(temperature=0.7, min_p=0.1, repetition_penalty=1.2)  # the long-form settings (DESIGN §5)


def write_selfdistill(model_dir: Path, out: Path, new_tokens: int = 1536, copies: int = 2, seed: int = 0,
                 log=print) -> Path:
    """Let the model write `copies` samples per brief, `new_tokens` each, in one batch; save the texts to
    `out` (documents separated by a form feed on its own line) and return `out`.

    One batched `generate` reads the weights once per step for the whole batch: 32 sequences of the default
    model ran at 80 tokens/s at first and 46 on average over 1536 tokens (a shared 2-core CPU: 18 minutes),
    against ~14 for one sequence. End-of-text is suppressed (as the writer does until the target is
    reached), so every sample is `new_tokens` long.
    """
    tf = transformers()



    tok = tf.AutoTokenizer.from_pretrained(str(model_dir))
    keep_float_copy(model_dir)  # transformers reads safetensors: a GGUF store model's float copy
    hf = tf.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    pad = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
    prompts = [prompt_ids(tok, apply_template(brief, kind), raw=False) for kind, brief in BRIEFS for _ in range(copies)]
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])  # left padding: all rows end together
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    gen_eos = hf.generation_config.eos_token_id
    eos = sorted({tok.eos_token_id, *(gen_eos if isinstance(gen_eos, list) else [gen_eos])} - {None})
    start = time.time()

    class Report(tf.StoppingCriteria):  # called once per generated token: a progress line, never a stop
        def __call__(self, input_ids, scores, **kw):
            done = input_ids.shape[1] - width
            if done % 128 == 0 and done:
                rate = done * len(prompts) / (time.time() - start)
                log(f"self-distill: {done}/{new_tokens} tokens per sample x {len(prompts)} ({rate:.0f} tok/s)")
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    torch.manual_seed(seed)
    with torch.inference_mode():
        gen = hf.generate(input_ids=ids, attention_mask=mask, do_sample=True, max_new_tokens=new_tokens,
                          min_new_tokens=new_tokens, suppress_tokens=eos or None, pad_token_id=pad,
                          stopping_criteria=[Report()], **DISTILL_SAMPLING)
    # NUL would make the file look binary and a form feed would split a sample: neither belongs in prose
    texts = [tok.decode(row[width:], skip_special_tokens=True).replace("\x00", "").replace("\f", "\n").strip()
             for row in gen]
    atomic_write_text(out, "\n\f\n".join(texts) + "\n")
    log(f"self-distill: wrote {len(texts)} samples, {gen[:, width:].numel()} tokens, to {out} "
        f"in {time.time() - start:.0f} s")
    return out


def atomic_write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# ---------------------------------------------------------------------------------------------------------
# Training data: text files -> token windows


def read_texts(data: Path) -> tuple[list[str], str]:
    """The documents in `data` (a UTF-8 text file, or a directory whose every non-hidden file is one) and a
    description for the metadata. One-line UserErrors for anything that is not usable text."""
    data = Path(data)
    if not data.exists():
        raise UserError(f"training data {data} does not exist.")
    if data.is_dir():
        files = sorted(p for p in data.rglob("*")
                       if p.is_file() and not any(part.startswith(".") for part in p.relative_to(data).parts))
        if not files:
            raise UserError(f"training data directory {data} has no files; put plain-text files in it.")
    else:
        files = [data]
    texts, total = [], 0
    for f in files:
        try:
            raw = f.read_bytes()[: MAX_DATA_BYTES - total]
        except OSError as e:
            raise UserError(f"training data {f} cannot be read ({e.strerror}).") from None
        if b"\x00" in raw:
            raise UserError(f"training data {f} looks binary (it contains NUL bytes); give plain UTF-8 text.")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            if e.start < len(raw) - 4 or total + len(raw) < MAX_DATA_BYTES:  # not just a character cut by the cap
                raise UserError(f"training data {f} is not UTF-8 text (byte {e.start}); convert it to UTF-8.") from None
            text = raw[: e.start].decode("utf-8")
        total += len(raw)
        if text.strip():
            texts.extend(t for t in text.split("\f") if t.strip())  # self-distilled files separate samples by \f
        if total >= MAX_DATA_BYTES:
            break
    if not texts:
        raise UserError(f"training data {data} is empty; give a file (or directory of files) with text in it.")
    what = f"{data.name} ({len(files)} file{'s' * (len(files) != 1)}, {total / 1e6:.2f} MB)"
    return texts, what


def token_windows(tok, texts: list[str], seq_len: int, where: str) -> list[np.ndarray]:
    """Each document cut into windows of `seq_len` tokens; each window starts at the beginning of a document
    or continues one, so its hidden states see the context the text was written in. A document's tail
    shorter than a quarter window is dropped."""
    windows: list[np.ndarray] = []
    total = 0
    for t in texts:
        ids = np.asarray(tok(t.strip(), add_special_tokens=False)["input_ids"], dtype=np.int64)
        total += len(ids)
        for a in range(0, len(ids), seq_len):
            if len(ids) - a >= max(seq_len // 4, 2) or a == 0 and len(ids) >= 2:
                windows.append(ids[a : a + seq_len])
    if total < 2 * seq_len or len(windows) < 2:
        raise UserError(f"training data {where} has {total} tokens; training needs at least 2 x --seq-len = "
                        f"{2 * seq_len} (one sequence to train on, one held out): give more text or a smaller --seq-len.")
    return windows


@torch.inference_mode()
def hidden_states(model, windows: list[np.ndarray], log=print) -> torch.Tensor:
    """The backbone's hidden states before the final norm for every window, concatenated [tokens, D],
    computed once: no LM-head product (logits_for is empty) and nothing for autograd to trace."""
    n = len(windows)
    out = torch.empty(sum(len(w) for w in windows), model.cfg.hidden_size, dtype=torch.float32)
    cache = model.new_cache(max(len(w) for w in windows))
    start, last, at = time.time(), time.time(), 0
    for k, w in enumerate(windows):
        cache.length = 0
        ids = torch.from_numpy(np.ascontiguousarray(w)).to(model.device)
        for a in range(0, len(w), PREFILL_CHUNK):
            piece = ids[a : a + PREFILL_CHUNK]
            pos = torch.arange(a, a + len(piece), device=model.device)
            _, h = model.forward(piece, pos, cache, logits_for=slice(0, 0))
            cache.length += len(piece)
            out[at : at + len(piece)] = h.float().cpu()
            at += len(piece)
        if time.time() - last > 15 or k == n - 1:
            last = time.time()
            log(f"hidden states: {k + 1}/{n} sequences ({at / (last - start + 1e-9):.0f} tok/s)")
    return out


def targets(windows: list[np.ndarray], gamma: int) -> np.ndarray:
    """[tokens, γ]: for the hidden state at t, head i's target is the token at t + 1 + i of the same window,
    or -1 past the window's end."""
    parts = []
    for w in windows:
        out = np.full((len(w), gamma), -1, dtype=np.int64)
        for i in range(1, gamma + 1):
            out[: max(0, len(w) - 1 - i), i - 1] = w[1 + i :]
        parts.append(out)
    return np.concatenate(parts)


def choose_vocab(train_targets: np.ndarray, size: int) -> np.ndarray:
    """The `size` most frequent target tokens (sorted ids): the heads' vocabulary."""
    ids, counts = np.unique(train_targets[train_targets >= 0], return_counts=True)
    keep = ids[np.argsort(-counts, kind="stable")[:size]]
    return np.sort(keep)
