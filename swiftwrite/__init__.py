"""swiftwrite: long documents from a local language model, faster, token for token unchanged."""

__version__ = "0.1.0"
