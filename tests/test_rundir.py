"""Run directory: what survives a kill, what is refused, and that a refusal says so in one sentence."""

import errno
import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from gates import Holds
from swiftwrite.base.errors import UserError
from swiftwrite.io.rundir import RunDir
from swiftwrite.io.runfiles import staging_dirs

CONFIG = {"model": "smollm2-135m", "max_tokens": 100, "sampling": {"temperature": 0.0}}


def make(path, chunks=((1, 2, 3),), drafter=None):
    """A run with one checkpoint after each chunk of ids; the text of id i is f"<{i}>"."""
    rd = RunDir.create(path, CONFIG, "Once upon a time", [7, 8, 9], "fp1234")
    for chunk in chunks:
        rd.append(list(chunk), "".join(f"<{i}>" for i in chunk))
        rd.checkpoint({"n": len(rd.tokens)}, drafter_state=drafter)
    return rd


def spawn(code, **env):
    """A python child that prints 'ready' when it has done its setup; returns it after that line. Its standard
    input is a pipe the test never writes: a child that reads it waits there until the test kills it."""
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, **env})
    assert child.stdout.readline().strip() == "ready", child.stderr.read()
    return child


# ---------------------------------------------------------------------------------------------------------
# round trips


def test_create_then_open_round_trips_config_prompt_ids_fingerprint_and_tokens(tmp_path):
    run = tmp_path / "runs" / "a"  # parents are created
    with make(run, chunks=[(1, 2, 3), (4, 5)], drafter=b"\x00drafter") as rd:
        rd.append([6], "<6>")
        rd.checkpoint({"tokens_per_s": 12.5}, drafter_state=b"d2", finished=True)
    with RunDir.open(run) as rd:
        assert rd.config == CONFIG and rd.prompt_text == "Once upon a time"
        assert rd.prompt_ids == [7, 8, 9] and rd.fingerprint == "fp1234"
        assert rd.tokens == [1, 2, 3, 4, 5, 6]
        assert rd.finished and rd.stats == {"tokens_per_s": 12.5} and rd.drafter_state() == b"d2"
        assert rd.recovered is None and rd.warnings == [] and not rd.text_damaged
    assert (run / "output.txt").read_text() == "<1><2><3><4><5><6>"


def test_reopened_run_keeps_appending_with_consistent_checksums(tmp_path):
    make(tmp_path / "r").close()
    for i in range(3):
        with RunDir.open(tmp_path / "r") as rd:
            rd.append([100 + i, -1, 2**31 - 1], "é…")  # negative, max int32 and multibyte text survive
            rd.checkpoint({"round": i})
    with RunDir.open(tmp_path / "r") as rd:
        assert rd.tokens == [1, 2, 3] + [x for i in range(3) for x in (100 + i, -1, 2**31 - 1)]
        assert rd.stats == {"round": 2} and rd.recovered is None
    assert (tmp_path / "r" / "output.txt").read_text() == "<1><2><3>" + "é…" * 3


def test_fresh_run_opens_with_no_tokens_and_empty_stats(tmp_path):
    RunDir.create(tmp_path / "r", CONFIG, "p", [1], "fp").close()
    with RunDir.open(tmp_path / "r") as rd:
        assert rd.tokens == [] and rd.stats == {} and not rd.finished and rd.drafter_state() is None


def test_create_accepts_an_existing_empty_directory(tmp_path):
    RunDir.create(tmp_path, CONFIG, "p", [1], "fp").close()
    assert RunDir.open(tmp_path).tokens == []


# ---------------------------------------------------------------------------------------------------------
# recovery and damage


def test_tokens_appended_after_the_last_checkpoint_are_dropped_on_open(tmp_path):
    rd = make(tmp_path)
    rd.append([4, 5], "<4><5>")  # flushed, never checkpointed: then "killed"
    rd.close()
    with open(tmp_path / "tokens.bin", "ab") as fh:
        fh.write(b"\x01\x02")  # and a torn half-token at the end
    with RunDir.open(tmp_path) as rd:
        assert rd.tokens == [1, 2, 3]
        assert "recovered from the checkpoint at 3 tokens" in rd.recovered
        rd.append([9], "<9>")
        rd.checkpoint({})
    assert (tmp_path / "output.txt").read_text() == "<1><2><3><9>"
    assert RunDir.open(tmp_path).tokens == [1, 2, 3, 9]


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_a_truncated_or_flipped_tokens_bin_is_refused(tmp_path, damage):
    make(tmp_path).close()
    data = bytearray((tmp_path / "tokens.bin").read_bytes())
    if damage == "truncate":
        data = data[:-4]
    else:
        data[5] ^= 0x10
    (tmp_path / "tokens.bin").write_bytes(bytes(data))
    for _ in range(2):  # the refusal releases the lock: the second attempt gives the same answer
        with pytest.raises(UserError, match=r"tokens\.bin is damaged .*cannot be resumed exactly"):
            RunDir.open(tmp_path)


def test_a_damaged_output_txt_is_flagged_and_can_be_rewritten(tmp_path):
    make(tmp_path).close()
    (tmp_path / "output.txt").write_text("<1><X><3>")
    with RunDir.open(tmp_path) as rd:
        assert rd.text_damaged and rd.tokens == [1, 2, 3]
        with pytest.raises(RuntimeError):
            rd.append([4], "<4>")
        rd.replace_text("<1><2><3>")
        rd.append([4], "<4>")
        rd.checkpoint({})
    with RunDir.open(tmp_path) as rd:
        assert not rd.text_damaged and rd.tokens == [1, 2, 3, 4]
    assert (tmp_path / "output.txt").read_text() == "<1><2><3><4>"


@pytest.mark.parametrize("corrupt", ['{"n_tokens": 5, "tokens_sha2', '{"n_tokens": 5}', "[]", ""])
def test_a_corrupt_state_json_falls_back_to_state_prev_json(tmp_path, corrupt):
    make(tmp_path, chunks=[(1, 2, 3), (4, 5)]).close()
    (tmp_path / "state.json").write_text(corrupt)
    with RunDir.open(tmp_path) as rd:
        assert rd.tokens == [1, 2, 3]
        assert "state.prev.json" in rd.recovered and "at 3 tokens" in rd.recovered


def test_both_state_files_corrupt_are_refused(tmp_path):
    make(tmp_path, chunks=[(1,), (2,)]).close()
    (tmp_path / "state.json").write_text("{")
    (tmp_path / "state.prev.json").unlink()
    with pytest.raises(UserError, match="checkpoint in .* is unreadable"):
        RunDir.open(tmp_path)


@pytest.mark.parametrize("damage", ["flip", "delete"])
def test_a_damaged_drafter_file_gives_none_and_a_warning(tmp_path, damage):
    make(tmp_path, drafter=b"drafter state").close()
    (f,) = tmp_path.glob("drafter-*.bin")
    if damage == "flip":
        f.write_bytes(b"drafter statE")
    else:
        f.unlink()
    with RunDir.open(tmp_path) as rd:
        assert rd.drafter_state() is None and rd.tokens == [1, 2, 3]
        assert len(rd.warnings) == 1 and f.name in rd.warnings[0]


def test_only_the_drafter_files_of_the_last_two_checkpoints_are_kept(tmp_path):
    with make(tmp_path, chunks=[(1,), (2,), (3,), (4,)], drafter=None) as rd:
        for i in range(5):
            rd.append([10 + i], "x")
            rd.checkpoint({}, drafter_state=b"state %d" % i)
        assert len(list(tmp_path.glob("drafter-*.bin"))) == 2
        rd.append([99], "y")
        rd.checkpoint({}, drafter_state=None)  # no drafter any more: only state.prev.json's file remains
    assert len(list(tmp_path.glob("drafter-*.bin"))) == 1
    (tmp_path / "state.json").write_text("{")  # falls back to state.prev.json, whose drafter file was kept
    with RunDir.open(tmp_path) as rd:
        assert rd.drafter_state() == b"state 4" and rd.warnings == []


def test_a_run_written_with_the_old_drafter_bin_name_still_gives_its_drafter(tmp_path):
    make(tmp_path, drafter=b"old layout").close()
    (f,) = tmp_path.glob("drafter-*.bin")
    f.rename(tmp_path / "drafter.bin")
    with RunDir.open(tmp_path) as rd:
        assert rd.drafter_state() == b"old layout"
        rd.append([4], "<4>")
        rd.checkpoint({}, drafter_state=b"new layout")
    assert not (tmp_path / "drafter.bin").exists()


def test_unreadable_meta_or_config_is_refused(tmp_path):
    make(tmp_path / "a").close()
    (tmp_path / "a" / "meta.json").write_text("{not json")
    make(tmp_path / "b").close()
    (tmp_path / "b" / "config.yaml").write_text("- just\n- a list\n")
    for run in ("a", "b"):
        with pytest.raises(UserError, match="run metadata .* is unreadable"):
            RunDir.open(tmp_path / run)


# ---------------------------------------------------------------------------------------------------------
# refusals at create / open


def test_create_refuses_an_existing_non_empty_directory_or_a_file(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "notes.txt").write_text("mine")
    (tmp_path / "f").write_text("mine")
    for p in (tmp_path / "d", tmp_path / "f"):
        with pytest.raises(UserError, match="already exists and is not an empty directory"):
            RunDir.create(p, CONFIG, "p", [1], "fp")
    assert os.listdir(tmp_path / "d") == ["notes.txt"] and (tmp_path / "f").read_text() == "mine"


def test_open_refuses_a_missing_path_a_file_and_a_plain_directory(tmp_path):
    (tmp_path / "f").write_text("x")
    (tmp_path / "plain").mkdir()
    with pytest.raises(UserError, match="does not exist"):
        RunDir.open(tmp_path / "missing")
    with pytest.raises(UserError, match="is a file"):
        RunDir.open(tmp_path / "f")
    with pytest.raises(UserError, match="not a swiftwrite run directory"):
        RunDir.open(tmp_path / "plain")
    assert os.listdir(tmp_path / "plain") == []  # no lock file dropped there


def test_a_create_that_fails_midway_leaves_nothing_that_looks_valid(tmp_path, monkeypatch):
    real_replace = os.replace

    def replace(src, dst):
        if str(dst).endswith("meta.json"):
            raise OSError(errno.ENOSPC, "No space left on device")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(UserError, match="No space left on device"):
        RunDir.create(tmp_path / "new", CONFIG, "p", [1], "fp")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError):
        RunDir.create(tmp_path / "empty", CONFIG, "p", [1], "fp")
    assert not (tmp_path / "new").exists() and os.listdir(tmp_path / "empty") == []
    assert sorted(os.listdir(tmp_path)) == ["empty"]  # no staging directory left either


def test_create_builds_in_a_hidden_staging_directory_and_renames_it_into_place(tmp_path, monkeypatch):
    seen = []
    real_rename = os.rename

    def rename(src, dst):
        seen.append((sorted(os.listdir(src)), os.path.exists(dst)))
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    RunDir.create(tmp_path / "run", CONFIG, "p", [1], "fp").close()
    (files, existed), = seen
    assert "meta.json" in files and "state.json" in files and not existed
    assert sorted(os.listdir(tmp_path)) == ["run"]


def test_a_staging_directory_left_by_a_killed_create_is_swept_and_the_path_stays_free(tmp_path):
    """A SIGKILL inside create() leaves only a hidden sibling; the same command works again and removes it."""
    run = tmp_path / "run"
    child = spawn(f"""
        import sys
        from swiftwrite.io import rundir
        real = rundir.atomic_write
        def slow(path, data, pause=0.0):
            real(path, data)
            if path.name == "state.json":
                print("ready", flush=True)
                sys.stdin.read()  # held here until the test kills it
        rundir.atomic_write = slow
        rundir.RunDir.create({str(run)!r}, {{"a": 1}}, "p", [1], "fp")
    """)
    (stage,) = staging_dirs(run)
    assert (stage / "meta.json").exists() and not run.exists()
    child.send_signal(signal.SIGKILL)
    child.wait()
    with pytest.raises(UserError, match="does not exist"):
        RunDir.open(run)
    RunDir.create(run, CONFIG, "p", [1], "fp").close()
    assert staging_dirs(run) == [] and (run / "meta.json").exists()


def test_a_config_that_yaml_cannot_write_is_rejected_before_touching_disk(tmp_path):
    with pytest.raises(Exception):
        RunDir.create(tmp_path / "new", {"x": object()}, "p", [1], "fp")
    assert not (tmp_path / "new").exists()


# ---------------------------------------------------------------------------------------------------------
# the lock


def test_a_second_open_in_the_same_process_is_refused(tmp_path):
    with make(tmp_path):
        with pytest.raises(UserError, match=f"in use by process {os.getpid()}"):
            RunDir.open(tmp_path)
    RunDir.open(tmp_path).close()  # released on close


def test_an_open_in_another_process_is_refused_until_the_holder_is_killed(tmp_path):
    make(tmp_path).close()
    holder = spawn(f"""
        import sys
        from swiftwrite.io.rundir import RunDir
        rd = RunDir.open({str(tmp_path)!r})
        print("ready", flush=True)
        sys.stdin.read()  # held here until the test kills it
    """)
    try:
        with pytest.raises(UserError, match=rf"in use by process {holder.pid}; wait for it to finish"):
            RunDir.open(tmp_path)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    with RunDir.open(tmp_path) as rd:  # the kernel released the dead holder's flock: stale lock taken over
        assert rd.tokens == [1, 2, 3]
        assert (tmp_path / "lock").read_text().strip() == str(os.getpid())


# ---------------------------------------------------------------------------------------------------------
# failing and interrupted checkpoints


def test_a_checkpoint_that_cannot_write_raises_and_the_previous_checkpoint_still_opens(tmp_path, monkeypatch):
    rd = make(tmp_path)
    rd.append([4, 5], "<4><5>")

    def replace(src, dst):
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(os, "replace", replace)
        with pytest.raises(UserError, match=r"\(No space left on device\); free space and run "
                                            r"`swiftwrite resume .*`: the last checkpoint at 3 tokens is intact"):
            rd.checkpoint({"n": 5})
    rd.close()
    with RunDir.open(tmp_path) as rd:
        assert rd.tokens == [1, 2, 3] and rd.stats == {"n": 3}
    assert not list(tmp_path.glob("*.tmp"))


def test_a_checkpoint_past_the_file_size_limit_raises_and_the_previous_checkpoint_still_opens(tmp_path):
    make(tmp_path).close()
    child = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
        import resource, signal, sys
        from swiftwrite.base.errors import UserError
        from swiftwrite.io.rundir import RunDir
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # get EFBIG instead of being killed
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
        rd = RunDir.open({str(tmp_path)!r})
        rd.append([4, 5], "<4><5>")
        try:
            rd.checkpoint({{}}, drafter_state=bytes(65536))
        except UserError as e:
            sys.exit(str(e))
    """)], capture_output=True, text=True)
    assert child.returncode == 1
    assert "(File too large)" in child.stderr and "checkpoint at 3 tokens is intact" in child.stderr
    with RunDir.open(tmp_path) as rd:
        assert rd.tokens == [1, 2, 3] and "recovered from the checkpoint at 3 tokens" in rd.recovered


@pytest.mark.parametrize("old_drafter", [None, b"old"], ids=["no-drafter", "with-drafter"])
def test_a_process_killed_inside_the_checkpoint_window_leaves_the_previous_checkpoint(tmp_path, old_drafter):
    """Killed with the new state written but not renamed, and the new drafter file already on disk: the
    previous checkpoint opens, with the drafter state it recorded (none, or the old one)."""
    make(tmp_path, drafter=old_drafter).close()
    with Holds(tmp_path.parent / f"{tmp_path.name}.holds") as holds:  # the checkpoint waits in its window (gates.py)
        child = spawn(f"""
            from swiftwrite.io.rundir import RunDir
            rd = RunDir.open({str(tmp_path)!r})
            rd.append([4, 5], "<4><5>")
            print("ready", flush=True)
            rd.checkpoint({{"n": 5}}, drafter_state=b"new")
        """, **holds.env())
        assert holds.next(child), child.stderr.read()  # the new state is written, not yet renamed
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert json.loads((tmp_path / "state.json.tmp").read_text())["n_tokens"] == 5
    assert len(list(tmp_path.glob("drafter-*.bin"))) == 1 + (old_drafter is not None)  # the new one, unrecorded
    with RunDir.open(tmp_path) as rd:
        assert rd.tokens == [1, 2, 3] and rd.stats == {"n": 3} and rd.warnings == []
        assert "recovered from the checkpoint at 3 tokens" in rd.recovered
        assert rd.drafter_state() == old_drafter
    assert not (tmp_path / "state.json.tmp").exists()
    assert len(list(tmp_path.glob("drafter-*.bin"))) == (old_drafter is not None)  # the unrecorded one swept
