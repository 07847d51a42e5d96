"""Threads under load (swiftwrite/models/threads.py): the governor leaves other processes the cores they use and takes
them back when they stop, never switches on one burst, never uses a thread count whose bits differ from the
starting count's, and the text written while it switches is plain decoding's, token for token, on the default
model with every draft source on."""

from __future__ import annotations

import pytest
import torch

from swiftwrite.models import threads
from swiftwrite.run import inputs
from swiftwrite.models.model import load_lean
from tiny import tiny_hf_model


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


class Machine:
    """Readings of a machine where each look comes one second after the last, this process used one core over
    it, and other processes used `load[i]` cores over look i."""

    def __init__(self, load: list[float]):
        self.load, self.t, self.own_s, self.busy_s, self.looks = load, 0.0, 0.0, 0.0, -1

    def clock(self) -> float:
        self.t += 1.0
        return self.t

    def busy(self) -> float:
        self.looks += 1
        self.own_s += 1.0
        self.busy_s += 1.0 + self.load[min(self.looks, len(self.load) - 1)]
        return self.busy_s

    def own(self) -> float:
        return self.own_s


def drive(load: list[float], probe=lambda n: True) -> tuple[list[int], list[str]]:
    m = Machine(load)
    gov = threads.Governor(2, probe, free=2, busy=m.busy, own=m.own, clock=m.clock)
    counts, said = [], []
    for _ in load:
        said += [s for s in [gov.tick()] if s]
        counts.append(gov.now)
    return counts, said


def test_wanted_leaves_other_processes_the_cores_they_use():
    assert threads.wanted(2, 2, 0.0) == 2
    assert threads.wanted(2, 2, 0.3) == 2  # a light background load costs less than a lost thread
    assert threads.wanted(2, 2, 1.0) == 1
    assert threads.wanted(2, 2, 2.0) == 1  # never below one
    assert threads.wanted(8, 16, 3.0) == 8  # cores to spare: nothing to give up
    assert threads.wanted(8, 8, 3.0) == 5


def test_governor_lowers_threads_under_load_and_raises_them_after(restore_threads):
    counts, said = drive([0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0])
    assert counts == [2, 2, 2, 2, 1, 1, 1, 1, 2, 2, 2]  # two looks agree before each change
    assert torch.get_num_threads() == 2
    assert len(said) == 2 and "1 thread" in said[0] and "again" in said[1]


def test_one_burst_of_load_changes_nothing(restore_threads):
    counts, said = drive([0, 0, 1, 0, 0, 1, 0, 0])
    assert set(counts) == {2} and not said


def test_a_count_whose_bits_differ_is_probed_once_and_never_used(restore_threads):
    asked = []
    counts, said = drive([0, 1, 1, 1, 1, 1, 1], probe=lambda n: asked.append(n) or False)
    assert set(counts) == {2} and not said
    assert asked == [1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_and_two_threads_compute_the_same_bits_on_a_tiny_model(dtype, tmp_path, restore_threads):
    path, _ = tiny_hf_model("qwen3", out_dir=tmp_path / "m")
    model = load_lean(path, dtype=dtype)
    torch.set_num_threads(2)
    reference = threads.signature(model)
    assert threads.same_bits(model, 1, reference)
    assert torch.get_num_threads() == 2  # the probe leaves the count as it found it


def test_the_probe_catches_a_forward_whose_bits_follow_the_thread_count(tmp_path, restore_threads):
    path, _ = tiny_hf_model("qwen3", out_dir=tmp_path / "m")
    model = load_lean(path)
    real = model.forward

    def drifting(*a, **k):  # a last-bit difference with the count, as another kernel partition could give
        logits, hidden = real(*a, **k)
        return logits + torch.get_num_threads() * 1e-6, hidden

    model.forward = drifting
    torch.set_num_threads(2)
    assert not threads.same_bits(model, 1, threads.signature(model))


TOKENS = 100  # the simulated load turns every 4 steps: 24 count changes. Its two threads wait at every barrier
# while the suite's other worker runs (151 s for 300 tokens in CI, 4 s alone), so the run is kept short


def test_text_written_while_threads_follow_the_load_is_plain_decodings(default_model_dir, tmp_path, monkeypatch,
                                                                      restore_threads):
    """The default model, --draft all and --draft none (greedy with the default penalty, DRY and suppression),
    the governor driven through a load that comes and goes every few steps so the count changes many times; the
    plain run keeps its two threads. Both write the same tokens."""
    from swiftwrite.run import writer
    from swiftwrite.base.config import Config

    torch.set_num_threads(2)
    made = []

    def switching(model, flag, device):
        gov = real_governor_for(model, flag, device)
        assert gov is not None  # a 2-thread CPU run with /proc/stat: the governor is on by default
        m = Machine(([0.0] * 4 + [1.0] * 4) * 1000)
        gov.busy, gov.own, gov.clock = m.busy, m.own, m.clock
        made.append(gov)
        return gov

    real_governor_for = threads.governor_for
    out = {}
    for name, draft, fn in (("plain", "none", lambda *a: None), ("switching", "all", switching)):
        monkeypatch.setattr(threads, "governor_for", fn)
        cfg = Config(tokens=TOKENS, draft=draft, temperature=0.0, context=256, backend="torch").validate()
        given = inputs.read(cfg, str(default_model_prompt(tmp_path)), tmp_path / name, tmp_path / f"{name}.md",
                            tmp_path / f"{name}.json")
        rc = writer.generate(given, True, True)
        assert rc == 0
        out[name] = (tmp_path / name / "tokens.bin").read_bytes()
    assert made and made[0].changes >= 10 and made[0].allowed.get(1) is True, made[0].changes
    assert len(out["plain"]) == 4 * TOKENS and out["switching"] == out["plain"]


def default_model_prompt(tmp_path):
    p = tmp_path / "brief.txt"
    p.write_text("Write a short story about a lighthouse keeper who finds a message in a bottle.")
    return p
