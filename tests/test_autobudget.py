"""The automatic budget on its own, without a model: it rests while no tree pays and verifies once one does; quiet
resting steps leave a check every CHECK_EVERY steps; a resting step's tree, checked against the tokens committed
later, moves the rates and the calibration as verification would; a look of the costly sources that accepts nothing
doubles the wait for the next (up to EXPLORE_MAX); the engine's own time is the medians' difference, the first tree
not counted; the cost curve is measured again once per context bucket.

The driver below calls the controller at the points the engine does (engine.Engine._propose, _learn, _commit)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from swiftwrite.decoding.autobudget import (CALIBRATION_DECAY, CALIBRATION_PRIOR, CHECK_EVERY, COST_BUCKET, EXPLORE_EVERY,
                                   EXPLORE_MAX, TIMED, AutoBudget)
from swiftwrite.decoding.budget import SIZES, CostCurve
from swiftwrite.decoding.drafting import AcceptanceStats
from swiftwrite.decoding.tree import DraftTree

HOPELESS = CostCurve(SIZES, [1.0, 100.0, 200.0, 400.0, 800.0, 1600.0, 3200.0])  # no draft node ever pays
FLAT = CostCurve(SIZES, [1.0, 1.0, 1.0, 1.01, 1.02, 1.05, 1.1])  # a GPU: any decent node pays
CHEAP, COSTLY = 0, 2  # source ids (as engine.SOURCES numbers recycling and heads)
GUESS = {CHEAP: 11, COSTLY: 12}  # each source's guess for the token after the root
CACHE = SimpleNamespace(length=100)


def controller(cost=HOPELESS, cost_at=None) -> AutoBudget:
    sources = [SimpleNamespace(id=CHEAP, costly=False), SimpleNamespace(id=COSTLY, costly=True)]
    return AutoBudget(AcceptanceStats(3), sources, cost, cost_at)


def tree_of(root: int, guesses: dict[int, int], score: float = 0.5) -> DraftTree:
    tree = DraftTree()
    tree.reset(root)
    for src, token in guesses.items():
        tree.add(0, token, score, source=src)
    return tree


def drive(auto: AutoBudget, steps: int, text) -> list[str]:
    """Resting steps as the engine runs them (nothing is verified here): returns each step's kind, "quiet",
    "check" (the cheap source proposes) or "look" (the costly one too: every source); `text(i)` is the token step i commits."""
    hist, kinds = [1], []
    for i in range(steps):
        if auto.quiet():
            kinds.append("quiet")
        else:
            kinds.append("check" if auto.resting() else "look")
            proposing = [CHEAP] if auto.resting() else [CHEAP, COSTLY]
            tree = DraftTree()
            tree.reset(hist[-1])
            for src in proposing:  # the costly source's guess scores higher: a look's shadow check holds it
                tree.add(0, GUESS[src], 0.5 + 0.1 * (src == COSTLY), source=src)
            assert auto.choose(tree, 1, 63, len(hist), CACHE) == 0
        hist.append(text(i))
        auto.check_shadows(np.array(hist), len(hist))
    return kinds


def test_it_rests_while_no_tree_pays_with_a_check_every_few_steps():
    auto = controller()
    assert not auto.resting()  # nothing has rested yet: the first step drafts with every source
    kinds = drive(auto, 3 * EXPLORE_EVERY, lambda i: 3)
    assert kinds[0] == "look" and kinds[1:CHECK_EVERY] == ["quiet"] * (CHECK_EVERY - 1)
    checks = [i for i, k in enumerate(kinds) if k != "quiet"]
    assert max(b - a for a, b in zip(checks, checks[1:])) == CHECK_EVERY  # a repetition waits CHECK_EVERY - 1 at most
    assert [i for i, k in enumerate(kinds) if k == "look"] == [0, EXPLORE_EVERY]


def test_a_tree_that_pays_is_verified_and_ends_the_rest():
    auto = controller()
    drive(auto, CHECK_EVERY, lambda i: 3)
    assert auto.resting() and not auto.quiet()  # a check step: the cheap source proposes, the budget is chosen
    auto.cost = FLAT  # say the context moved to a cheaper curve
    assert auto.choose(tree_of(1, {CHEAP: 11}, score=0.9), 1, 63, CHECK_EVERY + 1, CACHE) == 1
    assert not auto.resting() and not auto.quiet()


def test_a_shadow_check_that_would_have_been_accepted_raises_the_calibration():
    for committed, above in ((11, True), (99, False)):
        auto = controller()
        assert auto.calibration == 1.0
        assert auto.choose(tree_of(5, {CHEAP: 11}, score=0.5), 1, 63, 10, CACHE) == 0
        hist = np.arange(20)
        auto.check_shadows(hist, 10)  # the token the node guesses (position 10) is not there yet
        assert auto.stats.tried.sum() == 0
        hist[10] = committed
        auto.check_shadows(hist, 11)
        real = CALIBRATION_PRIOR * CALIBRATION_DECAY + int(above)
        assert auto.calibration == pytest.approx(real / (CALIBRATION_PRIOR * CALIBRATION_DECAY + 0.5))
        assert (auto.stats.tried.sum(), auto.stats.hit.sum()) == (1, int(above))  # counted as verification would
        auto.check_shadows(hist, 12)
        assert auto.stats.tried.sum() == 1  # ... once


def test_a_verified_tree_moves_the_calibration_by_what_was_accepted():
    auto = controller(cost=FLAT)
    budget = auto.choose(tree_of(1, {CHEAP: 11, COSTLY: 12}, score=0.9), 1, 63, 10, CACHE)
    auto.verified(0)
    assert budget == 2 and auto.calibration == pytest.approx(1.98 / (1.98 + 1.8))


def test_taken_back_tokens_decide_no_shadow_check():
    auto = controller()
    auto.choose(tree_of(5, {CHEAP: 11}), 1, 63, 10, CACHE)
    auto.forget()
    auto.check_shadows(np.full(20, 11), 20)
    assert auto.stats.tried.sum() == 0 and auto.calibration == 1.0


def test_a_look_that_accepts_nothing_doubles_the_wait_up_to_the_max_and_one_that_does_resets_it():
    auto = controller()
    kinds = drive(auto, 800, lambda i: 3)  # no guess is ever right
    looks = [i for i, k in enumerate(kinds) if k == "look"]
    gaps = [b - a for a, b in zip(looks, looks[1:])]
    assert looks[0] == 0 and gaps[:5] == [EXPLORE_EVERY, 2 * EXPLORE_EVERY, 4 * EXPLORE_EVERY, EXPLORE_MAX, EXPLORE_MAX]
    assert set(gaps[3:]) == {EXPLORE_MAX}

    auto = controller()
    kinds = drive(auto, 200, lambda i: GUESS[CHEAP])  # the cheap source's guesses only: the looks still back off
    assert auto._explore_every == EXPLORE_MAX

    auto = controller()
    kinds = drive(auto, 200, lambda i: GUESS[COSTLY])  # the costly source's guess is right at every look
    looks = [i for i, k in enumerate(kinds) if k == "look"]
    assert set(b - a for a, b in zip(looks, looks[1:])) == {EXPLORE_EVERY}


def test_timing_skips_the_first_tree_and_takes_the_medians_difference():
    ten_ms = CostCurve(SIZES, [0.01] * len(SIZES))
    auto = controller(cost=ten_ms)
    for _ in range(3):
        auto.timed(1, 0.012)  # resting steps: 2 ms beyond the forward
    auto.timed(5, 1.0)  # the first tree: warm-up, not counted
    auto.timed(5, 0.04)
    auto.timed(5, 0.04)
    assert auto.extra == 0.0  # two trees are two steps' noise
    auto.timed(5, 0.5)  # a stall
    assert auto.extra == pytest.approx(0.03 - 0.002)  # the median ignores it
    for _ in range(TIMED):
        auto.timed(5, 0.02)
    assert auto.extra == pytest.approx(0.008)  # the last TIMED trees only

    auto = controller(cost=ten_ms)
    for seconds in (1.0, 0.015, 0.015, 0.015):
        auto.timed(5, seconds)
    assert auto.extra == pytest.approx(0.005)  # no resting step timed: they count 0

    auto = controller(cost=None)
    for seconds in (1.0, 0.5, 0.5, 0.5):
        auto.timed(5, seconds)
    assert auto.extra == 0.0  # no curve to price the forwards with: nothing is timed


def test_the_cost_curve_is_measured_again_once_per_context_bucket():
    calls = []

    def cost_at(cache):
        calls.append(cache.length)
        return FLAT

    auto = controller(cost=None)
    auto.use_costs(cost_at, SimpleNamespace(length=100))
    assert auto.cost is FLAT and calls == [100]
    for length in (500, COST_BUCKET - 1, COST_BUCKET, COST_BUCKET + 300, 2 * COST_BUCKET + 5, 2 * COST_BUCKET + 6):
        auto.choose(tree_of(1, {CHEAP: 11}), 1, 63, 10, SimpleNamespace(length=length))
    assert calls == [100, COST_BUCKET, 2 * COST_BUCKET + 5]

    auto = controller(cost=FLAT)  # a curve without cost_at is kept whatever the context
    auto.choose(tree_of(1, {CHEAP: 11}), 1, 63, 10, SimpleNamespace(length=5 * COST_BUCKET))
    assert auto.cost is FLAT
