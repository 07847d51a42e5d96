"""Each rule about which settings go together is worded once (base/rules.py): the sentence a user gets is
written nowhere else in swiftwrite/, so two places that check one rule cannot drift into two wordings."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

from swiftwrite.base import rules

SOURCE = Path(rules.__file__).resolve().parent.parent


def sentences() -> dict[str, str]:
    """Every rule's sentence, functions called with placeholder arguments."""
    out = {}
    for name, value in vars(rules).items():
        if name.startswith("_"):
            continue
        if isinstance(value, str) and name.isupper():
            out[name] = value
        elif inspect.isfunction(value) and value.__module__ == rules.__name__:
            params = inspect.signature(value).parameters
            out[name] = value(*[f"<{p}>" if p not in ("asked", "world", "tp") else 7 for p in params])
    return out


def fixed_words(sentence: str) -> list[str]:
    """The runs of a sentence between its placeholders, long enough to be its own wording."""
    return [part.strip() for part in re.split(r"<\w+>|\b7\b", sentence) if len(part.strip()) >= 20]


def test_every_rule_has_a_sentence_that_says_what_to_do():
    found = sentences()
    assert len(found) >= 4
    for name, s in found.items():
        assert s.endswith(".") and ";" in s or ". " in s, (name, s)


def test_no_module_words_a_rule_again():
    texts = {p: p.read_text() for p in SOURCE.rglob("*.py") if p.name != "rules.py"}
    for name, sentence in sentences().items():
        for words in fixed_words(sentence):
            # a wording split over two source lines is still the same wording: compare with the quotes and
            # line breaks between string pieces taken out
            probe = words[:40]
            for path, text in texts.items():
                joined = re.sub(r'"\s*\n\s*f?"', "", text)
                assert probe not in joined, f"{path} words rule {name} again: {probe!r}"
