"""transformers, imported on first use and from here only.

It is the one heavy dependency most runs can skip until late: ~0.6 s to import and a second more for its tokenizer
and model classes, which a run that fails on its input, `--help`, or a lean model's forward never need. Everything
that reads a tokenizer, a transformers configuration or a transformers model asks `transformers()` for the package.
"""

from __future__ import annotations


def transformers():
    """The transformers package (its classes load lazily on first attribute access)."""
    import transformers  # heavy optional dependency (~0.6 s, more for its classes): imported only when needed

    return transformers
