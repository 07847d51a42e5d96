"""swiftwrite: long documents from a local language model, faster, token for token unchanged."""

from pathlib import Path as _Path

__version__ = "0.1.0"

# The GPU kernels live at the top of the checkout, in kernels/, and install as swiftwrite.kernels (pyproject.toml).
# Not as a top-level `kernels`: that is the import name of Hugging Face's `kernels` package, which transformers
# 5.25 requires and imports, and a top-level kernels/ of ours on the path (a checkout's root, as `python -m` and
# the bench scripts put it there) shadowed it and broke every transformers model class. kernels/ has no
# __init__.py, so where both are on the path the installed package wins. From a checkout, swiftwrite.kernels
# is found by looking in the checkout's root as well:
_checkout = _Path(__file__).resolve().parent.parent
if (_checkout / "kernels" / "tree_attention.py").is_file() and not (_Path(__file__).parent / "kernels").is_dir():
    __path__.append(str(_checkout))  # noqa: F821 (a package's __path__)
