"""A model's files short of its weights: the GGUF header, the configuration and the tokenizer, each checked with a
sentence that says what to do. transformers is imported on first use (hf.py); these checks are cheap and come before
any weight is read.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..base.errors import UserError, first_line
from ..base.hf import transformers
from ..base.modelconfig import SUPPORTED_ARCHS, ModelConfig, read_hf_config
from .hfmodel import config_from, weight_files


def check_gguf_header(path: Path) -> None:
    """A .gguf that is not one is refused here, in a millisecond, not after seconds of starting a conversion."""
    if path.suffix != ".gguf" or not path.is_file():
        return  # not a GGUF path, or a missing one: store.resolve says so
    try:
        with open(path, "rb") as fh:
            head = fh.read(8)
    except OSError as e:
        raise UserError(f"GGUF file {path} cannot be read ({e.strerror}).") from None
    if head[:4] != b"GGUF" or int.from_bytes(head[4:8], "little") not in (2, 3):
        raise UserError(f"{path} is not a GGUF model file (no GGUF v2/v3 header); check the file or download it again.")


def model_config(path: Path, say) -> tuple[ModelConfig, bool]:
    """The model's configuration, and whether the lean forward runs it (else transformers does, said to `say`)."""
    raw = read_hf_config(path)
    if isinstance(raw, dict) and raw.get("model_type") not in SUPPORTED_ARCHS:
        return _fallback_config(path, raw, say), False
    try:
        return ModelConfig.from_hf(raw), True
    except KeyError as e:
        raise UserError(f"{path / 'config.json'} lacks {e}; it is not a complete model configuration, "
                        "re-download or re-convert the model.") from None
    except (TypeError, AttributeError, ValueError):
        raise UserError(f"{path / 'config.json'} is not a model configuration (a JSON object of settings); "
                        "re-download or re-convert the model.") from None


def _fallback_config(path: Path, raw: dict, say) -> ModelConfig:
    tf = transformers()
    tf.utils.logging.set_verbosity_error()
    if not weight_files(path):
        raise UserError(f"{path} has a '{raw.get('model_type')}' configuration but no weights "
                        "(*.safetensors or pytorch_model.bin); check the model directory.")
    try:
        mcfg = config_from(tf.AutoConfig.from_pretrained(str(path)))
    except UserError:
        raise
    except Exception as e:  # an architecture this transformers does not know, or a broken config
        raise UserError(f"architecture '{raw.get('model_type')}' of {path} is not in the lean forward's family "
                        f"({', '.join(SUPPORTED_ARCHS)}) and transformers cannot read it either ({first_line(e)}).") from None
    say(f"architecture '{mcfg.arch}' is outside the lean forward's family ({', '.join(SUPPORTED_ARCHS)}); "
        "running it through transformers, which is slower, and without multi-token heads.")
    return mcfg


# tokenizer classes with no model-specific code: the tokenizer.json's own pipeline, whatever the architecture
GENERIC_TOKENIZERS = ("TokenizersBackend", "PreTrainedTokenizerFast")


def load_tokenizer(path: Path):
    tf = transformers()
    tf.utils.logging.set_verbosity_error()
    # AutoTokenizer reads the model's configuration to pick a class even where tokenizer_config.json names one, and
    # that import chain (a configuration class, activations, torch.distributed) cost 2.2 of its 2.4 s here; a
    # generic class named there is the one it would pick, so it is loaded directly (0.16 s)
    named = _tokenizer_class(path)
    try:
        if named in GENERIC_TOKENIZERS and hasattr(tf, named):
            return getattr(tf, named).from_pretrained(str(path))
        return tf.AutoTokenizer.from_pretrained(str(path))
    except Exception as e:  # transformers raises whatever its backend raises for a bad tokenizer file
        raise UserError(f"the tokenizer in {path} cannot be loaded ({first_line(e, 120)}); "
                        "re-download or re-convert the model.") from None


def _tokenizer_class(path: Path) -> str | None:
    """The class tokenizer_config.json names (None: none, or no readable file; AutoTokenizer then decides)."""
    try:
        named = json.loads((path / "tokenizer_config.json").read_text(encoding="utf-8")).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        return None
    return named if isinstance(named, str) else None
