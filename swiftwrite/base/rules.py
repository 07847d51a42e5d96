"""The rules about which settings go together, each worded once: the sentence a user gets when a combination cannot
run. Where a rule is checked depends on what it needs to know (the options alone: config.validate; the model's
files: the assembly; the backend: backends.py), but its wording lives here, so a rule refused in two places says the
same thing in both, and tests/test_rules.py checks that no other module words it again.
"""

from __future__ import annotations

# llama.cpp (--backend ggml, ggml-repacked) runs in one process
GGML_ONE_PROCESS = "the ggml backend runs llama.cpp in one process; drop --tp, or use --backend torch for tensor parallelism."


def tp_against_world(asked: int, world: int) -> str:
    """--tp given to a command that already runs as a group of ranks (torchrun, or a --tp launch) of another size."""
    return (f"--tp {asked} was given, but this command runs as {world} ranks; give the same number to both, or leave "
            "--tp out under torchrun.")


def another_model(run_dir, recorded: str, now: str, instead: str) -> str:
    """A run continued with a model whose fingerprint differs from the one that wrote it; `instead`: what to do."""
    return (f"{run_dir} was written with another model (fingerprint {recorded}, now {now}); resuming would not "
            f"continue the same text. {instead}")


def batch_tp(where: str, tp: int) -> str:
    """A batch's document with tensor parallelism: a batch writes in one process (or one per worker)."""
    return (f"{where}: tp {tp}: a batch writes its documents in one process; drop tp (or run the document with "
            "`swiftwrite generate --tp`).")
