"""The notes a run keeps past its window (run/memory.py): lore files are read as documented, the names recall picks
are the text's own, and with a memory, recalled names and lore pinned at every rebuild, plain, speculative, resumed
and memory-edited runs stay identical token for token.

The engine tests run the tiny sharpened model of test_outline.py with a toy word vocabulary: each id is a word (a
few of them names, places, sentence ends), so the model's random text has names to recall and keys to find, and a
small context rebuilds it many times.
"""

from __future__ import annotations

import re
import zlib

import numpy as np
import pytest
import torch

from swiftwrite.base.errors import UserError
from swiftwrite.decoding.engine import Engine, make_sources
from swiftwrite.decoding.sampling import Sampler, SamplerSettings
from swiftwrite.decoding.window import Window
from swiftwrite.models.model import load_lean
from swiftwrite.run import memory
from swiftwrite.run.memory import LoreEntry, Notes, named_entries, parse_lore, recall_names
from tiny import sharpened_tiny_model

class Words:
    """A word tokenizer that reads back what it wrote: each new word gets the next id."""

    def __init__(self):
        self.words: list[str] = []

    def encode(self, text: str) -> list[int]:
        ids = []
        for w in re.findall(r"\S+|\n", text):
            if w not in self.words:
                self.words.append(w)
            ids.append(self.words.index(w))
        return ids

    def decode(self, ids) -> str:
        return " ".join(self.words[i] for i in ids)


# ---------------------------------------------------------------------------------------------------------
# Lore files


def test_lore_entries_have_names_keys_and_text():
    text = """The writer's own preface, not an entry.

## Mara {keys: Mara, the keeper}
The lighthouse keeper, sixty, deaf in one ear.

She rows out at dawn.

## The Harrow {keys:Harrow , harbour}
A harbour town of slate roofs.
### a sub-heading stays in the text
"""
    got = parse_lore(text)
    assert got == [LoreEntry("Mara", ("Mara", "the keeper"), "The lighthouse keeper, sixty, deaf in one ear.\n\nShe rows "
                                                            "out at dawn."),
                   LoreEntry("The Harrow", ("Harrow", "harbour"),
                             "A harbour town of slate roofs.\n### a sub-heading stays in the text")]


@pytest.mark.parametrize("text, says", [
    ("## Mara\nthe keeper\n", "line 1: the entry 'Mara' has no keys"),
    ("## Mara {keys: Mara}\nx\n## Tobin {keys: , }\ny\n", "line 3: the entry 'Tobin' has no keys"),
    ("just notes, no entries\n", "has no entries"),
])
def test_lore_without_keys_or_entries_is_refused_in_one_sentence(text, says):
    with pytest.raises(UserError, match=re.escape(says)) as e:
        parse_lore(text, "--lore w.md")
    assert str(e.value).startswith("--lore w.md") and str(e.value).count(". ") == 0


@pytest.mark.parametrize("content, says", [(None, "does not exist"), (b"  \n\n", "is empty"),
                                           (b"## A {keys: a}\x00\n", "looks binary")])
def test_missing_empty_and_binary_memory_and_lore_files_are_refused(tmp_path, content, says):
    path = tmp_path / "notes.md"
    if content is not None:
        path.write_bytes(content)
    for read, flag in ((memory.read_memory, "--memory"), (memory.read_lore, "--lore")):
        with pytest.raises(UserError, match=says) as e:
            read(str(path))
        assert str(e.value).startswith(f"{flag} {path}") and e.value.exit_code == 1


def test_lore_is_chosen_most_recently_named_first_and_by_whole_words_in_any_case():
    entries = [LoreEntry("Mara", ("Mara",), ""), LoreEntry("Harrow", ("harrow", "the town"), ""),
               LoreEntry("Sela", ("Sela",), ""), LoreEntry("Ox", ("ox",), "")]
    kept = "Mara walked to HARROW. The town slept; Mara smiled. Seland and boxes are not names here."
    assert named_entries(entries, kept) == [0, 1]  # Mara last at 'smiled', Harrow's 'The town' before it
    assert named_entries(entries, "the town, then mara") == [0, 1]


def test_lore_past_its_budget_is_left_out_whole_and_shorter_entries_after_it_still_fit():
    words = Words()
    entries = [(LoreEntry("A", ("alpha",), ""), [1005] * 6), (LoreEntry("B", ("beta",), ""), [1006] * 20),
               (LoreEntry("C", ("gamma",), ""), [1007] * 4)]  # ids no word of the frame has
    out = words.encode("gamma beta alpha")
    notes = Notes([], 0, entries, 14, 0, words.encode, words.decode, recent=10)
    assert notes.lore_in(3, out) == ["A", "C"]  # alpha named last; beta's 20 tokens do not fit the 14 - label
    ids = notes.pin(3, out)
    assert ids[: len(notes.head)] == notes.head and ids.count(1006) == 0 and ids.count(1005) == 6 and ids.count(1007) == 4
    assert ids.index(1005) < ids.index(1007)


# ---------------------------------------------------------------------------------------------------------
# The text's own names


def test_recall_picks_names_used_three_times_outside_the_brief_most_used_first_with_their_first_sentence():
    text = ("The storm came in the night. Mara heard it first. She woke Tobin, and Tobin lit the lamp.\n"
            "Then Mara ran to the Harrow road. The Harrow was dark; old Quill waited there. "
            "When the boat came, Mara, Tobin and Quill pulled it in. Quill laughed at the Harrow.\n"
            "Later Edda came once. Edda, twice. When the sun rose it was over. When they slept, nothing. "
            "Brightly shone the lamp. Brightly, again. Brightly.")
    got = recall_names(text, brief="A story about the Harrow.")
    assert [(n, c) for n, c, _ in got] == [("Mara", 3), ("Tobin", 3), ("Quill", 3)]
    assert got[0][2] == "Mara heard it first." and got[2][2] == "The Harrow was dark; old Quill waited there."
    # Harrow: in the brief. Edda: twice. When, The, Then: also in lower case ('when', 'the', 'then' above or not at
    # all inside a sentence). Brightly: only ever at a sentence's start
    assert not {"Harrow", "Edda", "When", "The", "Then", "Brightly"} & {n for n, _, _ in got}


def test_the_names_note_stays_within_its_budget_most_used_first():
    names = ["Mara", "Tobin", "Quill", "Orrin", "Sela"]
    text = " ".join(f"{n} ran. Then {n} ran. Then {n} ran." + f" Then {n} ran." * (5 - k) for k, n in enumerate(names))
    words = Words()
    for budget in (0, 8, 12, 20, 40, 200):
        notes = Notes([], 0, [], 0, budget, words.encode, lambda ids: text)
        ids = notes.pin(5, [0] * 5)
        shown = re.findall(r"- (\w+):", words.decode(ids))
        assert len(ids) <= notes.reserve == budget + len(notes.head) + len(notes.end)
        assert shown == names[: len(shown)]  # most used first, and a name too long for what is left ends the list
        # the label (4 words) and the blank line after (1), then 5 words a name: as many names as fit
        assert len(shown) == min(len(names), max(0, (budget - 5) // 5))
    assert "- Mara: Mara ran.\n" in words.decode(ids).replace(" \n", "\n").replace("\n ", "\n")


# ---------------------------------------------------------------------------------------------------------
# The engine: a toy word vocabulary over the tiny model's ids

VOCAB = 128
NAMES = ["Mara", "Tobin", "Quill", "Orrin", "Sela", "Brask", "Vell", "Harrow"]
TEXT = ["", "", ""] + NAMES + [".", "!", "\n"] + [f"w{i}" for i in range(VOCAB - 3 - len(NAMES) - 3)]


def decode(ids) -> str:
    return " ".join(TEXT[int(i)] for i in ids if TEXT[int(i)])


def encode(text: str) -> list[int]:
    """Known words to their ids, any other word to a fixed id of its own (deterministic, like a tokenizer)."""
    return [TEXT.index(w) if w in TEXT else 3 + len(NAMES) + 3 + zlib.crc32(w.encode()) % 100
            for w in re.findall(r"\S+|\n", text)]


CONTEXT = 200  # with the ~70 reserved for notes: rebuilt every ~55 tokens, ~15 times over the 900
SETTINGS = {
    "greedy": SamplerSettings(penalty=1.3, window=32),
    "sample": SamplerSettings(temperature=0.8, min_p=0.1, penalty=1.3, window=32, seed=3),
}
DRAFTS = {"none": [], "all": ["recycling", "ngram"]}
PROMPT = torch.randint(20, VOCAB, (20,), generator=torch.Generator().manual_seed(7)).tolist()
MEMORY_A, MEMORY_B = "Mara keeps the light .", "Mara keeps the light . Tobin is her brother , gone to sea ."
LORE = [LoreEntry(n, (n,), f"{n} of the {w} house .") for n, w in zip(NAMES[:5], ["north", "salt", "grey", "red", "old"])]
N = 900

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path, _ = sharpened_tiny_model("qwen3", 4.0, seed=1, out_dir=tmp_path_factory.mktemp("qwen3-s1"),
                                   vocab_size=VOCAB, max_position_embeddings=2048)
    return load_lean(path)


def make_notes(edits=((0, MEMORY_A),), recall=24, lore_budget=24):
    versions = [(at, memory.memory_ids(text, encode)) for at, text in edits]
    lore = [(e, encode(f"- {e.name}: {e.text}\n")) for e in LORE]
    # the memory's reserve is fixed when the run starts (memory.json), whatever edits come later
    return Notes(versions, len(memory.memory_ids(MEMORY_B, encode)) + 2, lore, lore_budget, recall, encode, decode,
                 brief=decode(PROMPT))


def write(model, setting, drafts, n, history=(), edits=((0, MEMORY_A),), budget=16):
    """`n` tokens after `history` (a resume) with notes pinned at every rebuild: (output, steps, notes, window)."""
    notes = make_notes(edits)
    window = Window(CONTEXT, len(PROMPT) + notes.reserve)
    notes.recent = window.recent
    sources, stats = make_sources(list(drafts), VOCAB)
    engine = Engine(model, Sampler(SETTINGS[setting], VOCAB), window, sources, stats,
                    budget=budget if drafts else None, capacity=len(PROMPT) + N + 1)
    engine.pin_context(len(PROMPT), memory.pinned(notes, None, lambda: engine.S[len(PROMPT):].numpy()))
    engine.start(PROMPT + list(history))
    steps = list(engine.run(n))
    return list(history) + [t for s in steps for t in s.tokens], steps, notes, window


def rebuilds(window, total):
    """The output indexes where a run of `total` tokens rebuilt its context."""
    return sorted({window.span(len(PROMPT) + i)[0] + window.recent - len(PROMPT) for i in range(total)
                   if window.span(len(PROMPT) + i)[0] != window.prompt})


@pytest.fixture(scope="module")
def plain(model):
    return {s: write(model, s, [], N) for s in SETTINGS}


@pytest.mark.parametrize("setting", SETTINGS)
def test_the_notes_pinned_at_each_rebuild_hold_memory_names_and_lore_within_the_reserve(plain, setting):
    out, steps, notes, window = plain[setting]
    at = rebuilds(window, N)
    assert len(at) >= 8 and sum(s.rebuilt for s in steps) == len(at)
    blocks = [notes.pin(r, out) for r in at]
    assert all(len(b) <= notes.reserve for b in blocks)
    label, lore = notes.labels
    has = lambda b, part: any(b[i : i + len(part)] == part for i in range(len(b)))  # noqa: E731
    assert all(has(b, notes.versions[0][1]) for b in blocks)
    assert sum(has(b, label) for b in blocks) >= len(at) // 2, "names are recalled at most rebuilds"
    assert sum(has(b, lore) for b in blocks) >= len(at) // 2, "lore entries named in the kept text come back"
    # the block is the text's: the names note is what recall_names finds in the output before the rebuild
    r = at[-1]
    assert any(name in decode(notes.pin(r, out)) for name, _, _ in recall_names(decode(out[:r]), decode(PROMPT)))


@pytest.mark.parametrize("setting", SETTINGS)
def test_speculative_equals_plain_with_notes_across_rebuilds(model, plain, setting):
    out, steps, _, _ = write(model, setting, DRAFTS["all"], N, budget=8)
    ref = plain[setting][0]
    first = next((i for i, (a, b) in enumerate(zip(out, ref)) if a != b), None)
    assert out == ref, f"first difference at token {first}"
    assert max(len(s.tokens) for s in steps) >= 3 and len(steps) < 0.9 * N  # drafts were accepted


@pytest.mark.parametrize("setting", SETTINGS)
def test_a_killed_and_resumed_run_gives_the_uninterrupted_text(model, plain, setting):
    ref, _, _, window = plain[setting]
    at = rebuilds(window, N)
    for cut in (at[1], at[2] + 17, at[4] - 1, at[-1] + 5):  # at a rebuild, inside a span, just before one
        out, _, _, _ = write(model, setting, DRAFTS["all"], N - cut, history=ref[:cut])
        assert out == ref, f"resumed at {cut}: first difference at " \
            f"{next(i for i, (a, b) in enumerate(zip(out, ref)) if a != b)}"


@pytest.mark.parametrize("setting", SETTINGS)
def test_resumed_with_an_edited_memory_twice_equals_a_run_given_the_same_edits_at_the_same_places(model, plain,
                                                                                                  setting):
    ref, _, _, window = plain[setting]
    at = rebuilds(window, N)
    first, second = at[2] + 20, at[6] + 3  # inside spans: each edit takes effect at the next rebuild
    edits = ((0, MEMORY_A), (first, MEMORY_B), (second, "Sela rules the Harrow ."))
    whole, _, notes, _ = write(model, setting, [], N, edits=edits)
    # the edits changed the text, from the first rebuild after the first edit on, not before
    changed = next(i for i, (a, b) in enumerate(zip(whole, ref)) if a != b)
    assert changed >= min(r for r in at if r >= first)
    part, _, _, _ = write(model, setting, DRAFTS["all"], first, edits=edits[:1])
    part, _, _, _ = write(model, setting, DRAFTS["all"], second - first, history=part, edits=edits[:2])
    part, _, _, _ = write(model, setting, DRAFTS["all"], N - second, history=part, edits=edits)
    assert part == whole


def test_a_run_that_never_passes_its_window_has_no_notes_and_too_little_room_is_refused():
    class Tok:  # what memory.for_run reads of a tokenizer
        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": encode(text)}

        def decode(self, ids, skip_special_tokens=True):
            return decode(ids)

    rec = memory.record(MEMORY_A, LORE, encode)
    WIDE = 400  # room for the memory's reserve (its tokens and 64 for edits)
    # prompt + target within the window: no notes, nothing reserved (open_session then pins nothing)
    assert memory.for_run(rec, "names", 24, WIDE, len(PROMPT), len(PROMPT), WIDE - len(PROMPT), Tok(), "",
                          False) is None
    notes = memory.for_run(rec, "names", 24, WIDE, len(PROMPT), len(PROMPT), WIDE, Tok(), "", False)
    assert notes is not None and notes.memory_reserve == memory.memory_reserve(len(memory.memory_ids(MEMORY_A, encode)))
    assert notes.recall == memory.recall_budget(WIDE - len(PROMPT) - (notes.reserve - notes.recall))
    assert memory.for_run(None, "none", 24, WIDE, len(PROMPT), len(PROMPT), 1000, Tok(), "", False) is None
    with pytest.raises(UserError, match=r"leave \d+ of the 400-token context for writing, fewer than 64"):
        memory.for_run(rec, "none", 330, WIDE, len(PROMPT), len(PROMPT), 1000, Tok(), "", False)
    with pytest.raises(UserError, match="lore key .* is longer than the 10-token context"):
        memory.for_run(memory.record(None, [LoreEntry("X", ("a " * 11,), "")], encode), "none", 24, 10, 2, 2, 5,
                       Tok(), "", False)


def test_the_pin_is_a_function_of_the_output_before_the_rebuild_alone(plain):
    out, _, notes, window = plain["sample"]
    r = rebuilds(window, N)[3]
    a = notes.pin(r, np.array(out))
    b = notes.pin(r, np.array(out[:r] + [5] * (len(out) - r)))  # other tokens after r: the same block
    fresh = make_notes()  # a resumed process's
    fresh.recent = window.recent
    c = fresh.pin(r, out[:r])
    assert a == b == c and a
