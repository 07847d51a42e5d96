"""A batch's jobs file and directory, without a model: every line checked before anything is written, one sentence
naming the line for each thing wrong with it; the directory made whole, its manifest kept across a reopen.

Properties: a line's options win over the command line's, which win over the defaults; paths on a line are read
from the jobs file's folder; a document's job record gives back the input it was made from; nothing exists in
--out-dir after a refused jobs file.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from swiftwrite.base.errors import UsageError, UserError
from swiftwrite.io.batchdir import BatchDir
from swiftwrite.run.inputs import Inputs, read_jobs


def jobs_file(tmp_path: Path, *lines) -> Path:
    path = tmp_path / "jobs.jsonl"
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return path


def refused(tmp_path: Path, *lines, flags=None, error=UsageError) -> str:
    with pytest.raises(error) as e:
        read_jobs(str(jobs_file(tmp_path, *lines)), None, flags or {}, tmp_path / "batch")
    assert not (tmp_path / "batch").exists()  # before anything is written
    return str(e.value)


def test_each_line_is_a_document_with_the_command_lines_options_under_its_own(tmp_path):
    (tmp_path / "briefs").mkdir()
    (tmp_path / "briefs" / "one.txt").write_text("A story about a lighthouse.\n")
    jobs = read_jobs(str(jobs_file(tmp_path, {"prompt": "briefs/one.txt", "out": "one.md", "tokens": 300},
                                   "",  # blank lines are skipped, and the numbering keeps counting them
                                   {"prompt": "Write a report on tides.", "out": "two.md", "temperature": 0})),
                     None, {"tokens": "120", "seed": "7"}, tmp_path / "batch")
    assert [j.line for j in jobs] == [1, 3]
    one, two = (j.inputs for j in jobs)
    assert one.brief == "A story about a lighthouse.\n" and two.brief == "Write a report on tides."
    assert (one.cfg.tokens, one.cfg.seed) == (300, 7) and (two.cfg.tokens, two.cfg.temperature) == (120, 0.0)
    assert one.out == tmp_path / "one.md" and one.run_dir == tmp_path / "batch" / "runs" / jobs[0].name
    assert jobs[0].name == "001-one" and jobs[1].name == "002-two"


def test_a_job_record_gives_back_the_input_it_was_made_from(tmp_path):
    (tmp_path / "outline.md").write_text("## Dawn\n\n## Dusk {tokens: 100}\n")
    (tmp_path / "facts.txt").write_text("Tides rise twice a day.\n")
    job = read_jobs(str(jobs_file(tmp_path, {"prompt": "Tides.", "out": "t.md", "outline": "outline.md",
                                             "source": "facts.txt", "tokens": 400, "penalty": 1.1})),
                    None, {}, tmp_path / "batch")[0].inputs
    back = Inputs.from_record(json.loads(json.dumps(job.record())), job.run_dir, job.out, None)
    assert back.cfg == job.cfg and back.brief == job.brief and back.source == "Tides rise twice a day.\n"
    assert back.sections == job.sections and back.budgets == job.budgets


def test_a_lines_memory_and_lore_are_read_from_the_jobs_files_folder_and_kept_in_its_record(tmp_path):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "cast.md").write_text("Mara keeps the light.\n")
    (tmp_path / "notes" / "world.md").write_text("## Mara {keys: Mara, keeper}\nDeaf in one ear.\n")
    job = read_jobs(str(jobs_file(tmp_path, {"prompt": "A keeper.", "out": "k.md", "memory": "notes/cast.md",
                                             "lore": "notes/world.md", "recall": "none", "lore_budget": 64})),
                    None, {}, tmp_path / "batch")[0].inputs
    assert job.memory == "Mara keeps the light." and [e.keys for e in job.lore] == [("Mara", "keeper")]
    assert (job.cfg.recall, job.cfg.lore_budget) == ("none", 64)
    back = Inputs.from_record(json.loads(json.dumps(job.record())), job.run_dir, job.out, None)
    assert back.memory == job.memory and back.lore == job.lore
    old = {k: v for k, v in job.record().items() if k not in ("memory", "lore")}  # a record from before notes
    assert Inputs.from_record(old, job.run_dir, job.out, None).lore is None


@pytest.mark.parametrize("line, said", [
    ('{"prompt": "x", "out": "a.md"', "line 1 is not JSON"),
    ('["x", "a.md"]', "line 1 is a JSON list, not an object"),
    ({"prompt": "x", "out": "a.md", "tokns": 5}, "line 1: unknown option 'tokns'; did you mean 'tokens'?"),
    ({"prompt": "missing/brief.txt", "out": "a.md"}, "line 1: prompt file"),
    ({"out": "a.md"}, "line 1 has no \"prompt\""),
    ({"prompt": "x"}, "line 1 has no \"out\""),
    ({"prompt": "x", "out": "a.md", "tokens": 0}, "line 1: tokens must be between 1"),
    ({"prompt": "x", "out": "a.md", "temperature": "hot"}, "line 1: temperature must be a number"),
    ({"prompt": "x", "out": "a.md", "run_dir": "r"}, "line 1: run_dir is set for the whole batch"),
    ({"prompt": "x", "out": "a.md", "tp": 2}, "line 1: tp 2: a batch writes its documents in one process"),
    ({"prompt": "x", "out": "a.md", "outline": "none.md"}, "line 1: --outline"),
    ({"prompt": "x", "out": "a.md", "recall": "all"}, "line 1: recall must be one of names, none"),
])
def test_a_wrong_line_gets_one_sentence_naming_it_before_anything_is_written(tmp_path, line, said):
    message = refused(tmp_path, line, error=UserError)
    assert said in message and "jobs.jsonl" in message and "\n" not in message


def test_the_line_number_is_the_files_own_and_earlier_good_lines_do_not_start(tmp_path):
    message = refused(tmp_path, {"prompt": "x", "out": "a.md"}, "", {"prompt": "x", "out": "b.md", "seed": -1})
    assert "line 3: seed must be between 0" in message


def test_two_lines_with_the_same_out_are_refused_naming_both(tmp_path):
    message = refused(tmp_path, {"prompt": "x", "out": "a.md"}, {"prompt": "y", "out": "./a.md"})
    assert "line 2" in message and "line 1's too" in message


def test_an_empty_jobs_file_and_a_missing_one_are_refused(tmp_path):
    assert "is empty" in refused(tmp_path, "", "  ")
    with pytest.raises(UsageError, match="does not exist"):
        read_jobs(str(tmp_path / "nope.jsonl"), None, {}, tmp_path / "batch")


def test_an_existing_out_dir_is_refused_and_left_as_it_was(tmp_path):
    (tmp_path / "batch").mkdir()
    (tmp_path / "batch" / "mine.txt").write_text("keep")
    with pytest.raises(UserError, match="already exists.*swiftwrite resume"):
        read_jobs(str(jobs_file(tmp_path, {"prompt": "x", "out": "a.md"})), None, {}, tmp_path / "batch")
    assert [p.name for p in (tmp_path / "batch").iterdir()] == ["mine.txt"]


def test_a_batch_directory_is_made_whole_and_its_manifest_follows_each_mark(tmp_path):
    docs = [(1, "001-a", str(tmp_path / "a.md"), {"brief": "a"}), (2, "002-b", str(tmp_path / "b.md"), {"brief": "b"})]
    bd = BatchDir.create(tmp_path / "batch", "jobs.jsonl", docs)
    with pytest.raises(UserError, match="in use by process"):
        BatchDir.open(tmp_path / "batch")  # one process at a time
    bd.mark("002-b", "failed", why="its disk filled")
    bd.close()
    again = BatchDir.open(tmp_path / "batch")
    assert [(d["name"], d["status"], d["why"]) for d in again.documents] == \
        [("001-a", "pending", None), ("002-b", "failed", "its disk filled")]
    assert again.job("002-b") == {"brief": "b"}
    assert not list(tmp_path.glob(".swiftwrite-new-*"))  # no staging left behind
    again.close()
