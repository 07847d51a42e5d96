"""The benchmark's measures on inputs whose answers are known by hand."""

import pytest

from swiftwrite.base.metrics import (capitalised_share, distinct, distinct_n, distinct_per_window, first_divergence, glued_share, median,
                                speedup)


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


def test_distinct_per_window_covers_whole_windows_in_order_and_separates_salad_from_a_loop():
    salad = list(range(1000))  # every token new: word salad's signature
    loop = [7, 8, 9, 10, 11] * 100  # one short sentence over and over: a template loop's
    curve = distinct_per_window(salad + loop + [1, 2, 3], 500)
    assert curve == [1.0, 1.0, round(5 / 500, 3)]  # the 3-token tail is not a whole window
    assert distinct_per_window(loop[:499], 500) == []
    assert distinct_per_window(salad, 250) == [1.0] * 4


def test_glued_share_is_zero_for_prose_and_counts_the_characters_of_glued_words():
    prose = "The keeper climbed the stairs at dusk, responsibilities heavy on him, and lit the lamp."
    assert glued_share(prose) == 0.0  # a long real word (16 letters) is not glue
    assert glued_share("") == 0.0
    glued = "he said lifeselifebelovedlovely again"  # 23 of 34 non-space characters in the glued word
    assert glued_share(glued) == round(23 / 34, 4)
    assert glued_share("a " * 50 + "x" * 17) == round(17 / 67, 4)
    assert glued_share("well-known,not-quite-a-word-at-all") == 1.0  # letters counted, not characters


def test_capitalised_share_counts_words_that_start_with_a_capital():
    assert capitalised_share("The keeper lit the lamp at dusk.") == round(1 / 7, 4)
    assert capitalised_share("Just Want It Now so") == 0.8
    assert capitalised_share("") == 0.0 and capitalised_share("12 -- 34") == 0.0
    assert capitalised_share("Émile écrit") == 0.5  # letters beyond ASCII are words too


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


def _brute_longest_repeat(t):
    best = 0
    for L in range(1, len(t)):
        seen, found = set(), False
        for i in range(len(t) - L + 1):
            key = tuple(t[i : i + L])
            if key in seen:
                found = True
                break
            seen.add(key)
        if not found:
            break
        best = L
    return best


def test_longest_repeat_matches_brute_force_on_random_texts():
    import random

    from swiftwrite.base.metrics import longest_repeat

    for seed in range(200):
        r = random.Random(seed)
        t = [r.randrange(r.choice([2, 3, 5, 50])) for _ in range(r.randint(0, 60))]
        assert longest_repeat(t) == _brute_longest_repeat(t), t


def test_longest_repeat_of_a_loop_is_all_but_one_period():
    from swiftwrite.base.metrics import longest_repeat

    period = list(range(1000, 2025))  # the 1,025-token cycle of the old 100K run
    assert longest_repeat(list(range(50)) + period * 4) == 3 * len(period)
    assert longest_repeat(list(range(5000))) == 0


def test_the_loop_alarm_sees_a_1025_token_cycle_within_two_periods_and_not_an_ordinary_text():
    import random

    from swiftwrite.decoding.repetition import LoopWatch

    period = random.Random(3).choices(range(49_000), k=1025)
    watch = LoopWatch(random.Random(4).choices(range(49_000), k=3000))
    fired = None
    text = period * 3
    for i in range(0, len(text), 5):  # steps of a few tokens, as the engine commits them
        if watch.extend(text[i : i + 5]) >= 256 and fired is None:
            fired = i + 5
    assert fired is not None and fired <= 2 * len(period), fired
    assert watch.current == 2 * len(period)
    # and a text with only short repeats (a 10-token phrase now and then) never reaches the floor
    r = random.Random(5)
    calm = LoopWatch()
    phrase = list(range(10))
    for _ in range(300):
        assert calm.extend(r.choices(range(49_000), k=20) + phrase) < 16


def test_the_loop_alarm_is_the_same_grown_or_rebuilt():
    import random

    from swiftwrite.decoding.repetition import LoopWatch

    r = random.Random(9)
    text = r.choices(range(30), k=500) + list(range(100, 140)) * 5
    grown = LoopWatch()
    for i in range(0, len(text), 7):
        grown.extend(text[i : i + 7])
        assert grown.current == LoopWatch(text[: i + 7]).current


def test_lookup_hits_counts_tokens_that_repeat_what_followed_their_context_last_time():
    from swiftwrite.base.metrics import lookup_hits

    prompt = [1, 2, 3, 9, 1, 2, 4]  # after "1 2": 3, then 4 (the most recent)
    assert lookup_hits(prompt, [1, 2, 4], 2) == pytest.approx(1 / 3)  # 1 and 2 had no context match; 4 did
    assert lookup_hits(prompt, [1, 2, 3], 2) == 0.0  # 3 followed "1 2" once, but not most recently
    assert lookup_hits([5, 6, 7, 8], [5, 6, 7, 8], 1) == 0.75  # a copy of the prompt: all but its first token (after 8)
    assert lookup_hits([5], [6, 6, 6, 6], 1) == pytest.approx(2 / 4)  # the text's own repeats count too
    assert lookup_hits([1, 2], [], 1) == 0.0


def test_restated_share_is_the_share_of_the_text_ngrams_found_in_the_source():
    from swiftwrite.base.metrics import restated_share

    source = [1, 2, 3, 4, 5]
    assert restated_share(source, [2, 3, 4, 5], 4) == 1.0
    assert restated_share(source, [1, 2, 3, 4, 9, 9, 9], 4) == pytest.approx(1 / 4)
    assert restated_share(source, [9, 9], 4) == 0.0
