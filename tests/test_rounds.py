"""Rounds: a run continued from the writer's edit of its document (`resume --edited`, rounds.py).

Properties: a continued round is token-identical with drafting on and off (greedy and sampled), and a round
resumed mid-way gives the same tokens as the uninterrupted round; the run directory keeps the round (tokens
before the edit, the edited text byte for byte, where the edit began) and a kill between committing a round and
switching to it is finished by the next open; bad edited files are one sentence each and change no byte of the
run directory; `resume --out` will not overwrite an edited file.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from swiftwrite.io import rounds
from swiftwrite.base.durable import pack_ids, sha256
from swiftwrite.decoding.engine import Engine, make_sources
from swiftwrite.base.errors import UserError
from swiftwrite.models.model import load_lean
from swiftwrite.io.rundir import RunDir
from swiftwrite.decoding.sampling import Sampler
from swiftwrite.decoding.window import Window
from swiftwrite.run.edits import check_not_edited, rebuilt_text
from swiftwrite.run.writer import resume
from tiny_lossless import CONTEXT, DRAFTS, SETTINGS, VOCAB, prompt, tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_lean(tiny_model(tmp_path_factory.mktemp("tiny")))


def continue_round(model, settings, names, history: list[int], n: int) -> list[int]:
    """`n` tokens after prompt() + `history`, the way a round (or a resume inside one) starts: one prefill."""
    sources, stats = make_sources(list(names), VOCAB)
    p = prompt()
    engine = Engine(model, Sampler(settings, VOCAB), Window(CONTEXT, len(p)), sources, stats,
                    budget=16 if names else None, capacity=len(p) + len(history) + n + 1)
    engine.start(p + history)
    return [t for s in engine.run(n) for t in s.tokens]


def edit(tokens: list[int]) -> list[int]:
    """A writer's edit: a word changed in the middle, a paragraph cut, a line added at the end."""
    return tokens[:40] + [7, 8, 9] + tokens[60:150] + [11, 12, 13, 14]


@pytest.mark.parametrize("mode", ["greedy", "sample"])
def test_a_continued_round_is_the_same_with_drafting_on_and_off(model, mode):
    first = continue_round(model, SETTINGS[mode], (), [], 200)
    edited = edit(first)
    plain = continue_round(model, SETTINGS[mode], (), edited, 300)  # crosses context rebuilds (~117 tokens)
    for names in DRAFTS.values():
        if "heads" in names:
            continue  # the tiny model has no trained heads; recycling and ngram draft here
        assert continue_round(model, SETTINGS[mode], names, edited, 300) == plain, names


@pytest.mark.parametrize("mode", ["greedy", "sample"])
def test_a_round_resumed_mid_way_gives_the_uninterrupted_rounds_tokens(model, mode):
    edited = edit(continue_round(model, SETTINGS[mode], (), [], 200))
    whole = continue_round(model, SETTINGS[mode], ["recycling", "ngram"], edited, 240)
    for cut in (1, 57, 130):
        rest = continue_round(model, SETTINGS[mode], ["recycling", "ngram"], edited + whole[:cut], 240 - cut)
        assert whole[:cut] + rest == whole, cut


# ---------------------------------------------------------------------------------------------------------
# The run directory


def make_run(path: Path, tokens: list[int], text: str) -> None:
    rd = RunDir.create(path, {"model": "tiny", "tokens": 100}, "the prompt", [1, 5, 6], "fp")
    rd.append(tokens, text)
    rd.checkpoint({"target": 100, "tokens": len(tokens), "seconds": 1.0, "forward_passes": 3})
    rd.close()


def snapshot(path: Path) -> dict:
    return {p.relative_to(path): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def test_a_round_keeps_the_tokens_before_the_edit_and_the_edited_text_byte_for_byte(tmp_path):
    run = tmp_path / "run"
    make_run(run, [10, 11, 12, 13], "one two three four")
    edited = "one two THREE\n\n¡más!"
    with RunDir.open(run) as rd:
        rd.begin_round([10, 11, 40, 41, 42], edited, {"target": 9, "edit_at": 2}, edit_at=2)
        assert rd.round == 2 and rd.tokens == [10, 11, 40, 41, 42]
        rd.append([50], " five")
        rd.checkpoint({"target": 9, "edit_at": 2})
    with RunDir.open(run) as rd:
        assert rd.round == 2 and rd.tokens == [10, 11, 40, 41, 42, 50] and rd.stats["target"] == 9
    assert (run / "output.txt").read_bytes() == (edited + " five").encode()
    assert (run / "rounds/2/edited.txt").read_bytes() == edited.encode()
    assert (run / "rounds/2/before.txt").read_bytes() == b"one two three four"
    assert rounds.info(run, 2)["edit_at"] == 2 and rounds.info(run, 2)["tokens_before"] == 4


def test_a_kill_between_committing_a_round_and_switching_to_it_is_finished_by_the_next_open(tmp_path):
    run = tmp_path / "run"
    make_run(run, [10, 11, 12], "a b c")
    with RunDir.open(run) as rd:  # what begin_round does up to its commit point, and no further
        state = dict(rd._state, n_tokens=2, round=2, stats={"target": 5})
        state.update(tokens_sha256=sha256(pack_ids([10, 99])), text_bytes=3, text_sha256=sha256(b"a z"))
        rounds.commit(run, 2, before=rd.tokens, before_text=b"a b c", edited="a z", ids=[10, 99], state=state,
                      edit_at=1)
    (run / "rounds/.3.tmp").mkdir()  # and a later round killed before its commit: as if never begun
    with RunDir.open(run) as rd:
        assert rd.round == 2 and rd.tokens == [10, 99]
    assert (run / "output.txt").read_bytes() == b"a z" and not (run / "rounds/.3.tmp").exists()


@pytest.mark.parametrize("content, says", [
    (b"\x00\x01binary\xff", "not text"),
    (b"caf\xe9 au lait", "not UTF-8"),
    (b"  \n\n", "empty"),
    (b"Something else entirely.", "no longer shares"),
])
def test_a_bad_edited_file_is_one_sentence_and_changes_nothing_in_the_run(tmp_path, content, says):
    run = tmp_path / "run"
    make_run(run, [10, 11, 12], "Once upon a time")
    before = snapshot(run)
    bad = tmp_path / "edited.md"
    bad.write_bytes(content)
    with pytest.raises(UserError, match=says) as e:
        resume(run, 50, None, False, True, True, None, edited=bad)
    assert str(e.value).count(". ") == 0 and "\n" not in str(e.value)
    assert snapshot(run) == before


def test_resume_out_refuses_to_overwrite_an_edited_file_and_names_the_edited_command(tmp_path):
    run = tmp_path / "run"
    make_run(run, [10, 11, 12], "Once upon a time")
    out = tmp_path / "novel.md"
    with RunDir.open(run) as rd:
        out.write_text("Once upon a")  # a copy cut by a kill: not an edit
        check_not_edited(rd, out)
        out.write_text("Once upon a time, and more")  # ahead of the checkpoint: not an edit either
        check_not_edited(rd, out)
        out.write_text("Twice upon a time")
        with pytest.raises(UserError, match="--edited"):
            check_not_edited(rd, out)


class Bytes:
    """A byte tokenizer: id = byte + 3, enough for TextStream."""

    def decode(self, ids, skip_special_tokens=False):
        return bytes(i - 3 for i in ids if i >= 3).decode("utf-8", errors="replace")


def test_a_damaged_output_of_a_later_round_is_rebuilt_from_the_edited_text_then_the_tokens(tmp_path):
    run = tmp_path / "run"
    make_run(run, [100, 101], "ab")
    edited = "A  b"  # as the writer typed it: not what its ids decode to
    with RunDir.open(run) as rd:
        rd.begin_round([3 + ord("A"), 3 + ord("b")], edited, {"target": 9}, edit_at=0)
        rd.append([3 + ord("c")], "c")
        rd.checkpoint({"target": 9})
        assert rebuilt_text(rd, Bytes()) == "A  bc" == (run / "output.txt").read_text()
