"""The benchmark's measures on inputs whose answers are known by hand."""

import pytest

from swiftwrite.metrics import distinct, distinct_n, first_divergence, median, speedup


def test_distinct_n_counts_unique_ngrams_over_all_ngrams():
    toks = [1, 2, 1, 2, 1, 2]  # bigrams: 12 21 12 21 12 -> 2 unique of 5
    assert distinct_n(toks, 1) == pytest.approx(2 / 6)
    assert distinct_n(toks, 2) == pytest.approx(2 / 5)
    assert distinct_n(toks, 3) == pytest.approx(2 / 4)


def test_distinct_is_one_for_a_text_without_repeats_and_falls_for_a_loop():
    assert distinct(list(range(50)))["distinct_4"] == 1.0
    loop = [5, 6, 7] * 100
    assert distinct(loop)["distinct_4"] < 0.02


def test_distinct_of_a_text_shorter_than_n_is_zero():
    assert distinct_n([1, 2], 3) == 0.0


def test_first_divergence_finds_the_first_differing_position():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 9, 3]) == 1
    assert first_divergence([1, 2, 3], [1, 2]) == 2  # a shorter output diverges where it stops


def test_speedup_is_a_ratio_and_undefined_without_a_baseline():
    assert speedup(30.0, 15.0) == 2.0
    assert speedup(30.0, 0.0) is None


def test_median_of_odd_and_even_counts():
    assert median([3, 1, 2]) == 2
    assert median([4, 1, 3, 2]) == 2.5
    with pytest.raises(ValueError):
        median([])
