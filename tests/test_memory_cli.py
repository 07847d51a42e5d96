"""Memory and lore end to end: `swiftwrite generate --memory --lore` and `resume --memory` as subprocesses on the kill
sweep's tiny random model (tests/killsweep.py: the default model's tokenizer, an LM head that writes the ids of an
English sentence), with a small --context so the context is rebuilt several times. Properties: drafting = plain
decoding with the notes pinned; a run stopped and resumed gives the uninterrupted text; an edited memory is kept
in the run directory with the index it took effect at, and changes nothing before the next rebuild.
"""

from __future__ import annotations

import json

import pytest

import killsweep
from test_cli import clean_env, read_tokens, sw, text_of

TOKENS = 400
CONTEXT = 320  # the prompt (~40), the memory's reserve (~110) and the lore budget (64): rebuilt every ~50 tokens
MEMORY = "The keeper is Mara Vell, sixty. Her brother Tobin drowned twenty years ago.\n"
EDITED = "The keeper is Mara Vell, sixty. The stranger on the shingle is her brother Tobin, alive.\n"
LORE = "## The lamp {keys: lamp, light}\nA Fresnel lens, cracked in the storm of 1952.\n\n## Sea {keys: sea}\nGrey.\n"


@pytest.fixture(scope="module")
def work(tmp_path_factory, default_model_dir):
    w = tmp_path_factory.mktemp("memory-cli")
    model = killsweep.build_tiny_model(w / "tiny", default_model_dir)["path"]
    (w / "prompt.txt").write_text("A lighthouse keeper finds a stranger on the shingle.\n")
    (w / "memory.md").write_text(MEMORY)
    (w / "edited.md").write_text(EDITED)
    (w / "lore.md").write_text(LORE)
    return w, model


def args(work, name, *extra, draft="all", tokens=TOKENS):
    w, model = work
    return ["generate", w / "prompt.txt", "--model", model, "--run-dir", w / name, "--tokens", tokens, "--chunk", 16,
            "--context", CONTEXT, "--memory", w / "memory.md", "--lore", w / "lore.md", "--lore-budget", 64,
            "--draft", draft, "--budget", 8, "--threads", 1, "--temperature", "0.8", "--seed", 5, "--quiet", *extra]


def run(work, *a):
    proc = sw(*a, env=clean_env(SWIFTWRITE_HOME=str(work[0] / "home")), cwd=work[0])
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")
    return proc


def test_drafting_resume_and_an_edited_memory(work):
    w, _ = work
    run(work, *args(work, "plain", draft="none"))
    run(work, *args(work, "spec", "--stats-json", w / "spec.json"))
    assert read_tokens(w / "spec") == read_tokens(w / "plain") and text_of(w / "spec") == text_of(w / "plain")
    stats = json.loads((w / "spec.json").read_text())
    assert stats["mean_tokens_per_forward"] > 1.1 and stats["notes"]["memory_versions"] == 1
    assert set(stats["notes"]["lore_in"]) <= {"The lamp", "Sea"}
    meta = json.loads((w / "plain" / "meta.json").read_text())
    assert meta["format"] == 3
    # stopped at 150 tokens and resumed (the run's own memory): the uninterrupted text
    run(work, *args(work, "resumed", tokens=150))
    run(work, "resume", w / "resumed", "--tokens", TOKENS, "--quiet")
    assert read_tokens(w / "resumed") == read_tokens(w / "plain")
    # stopped at 150 and resumed with an edited memory: recorded from 150 on, the same text until the next rebuild
    run(work, *args(work, "edited", tokens=150))
    run(work, "resume", w / "edited", "--tokens", TOKENS, "--memory", w / "edited.md", "--quiet")
    kept = json.loads((w / "edited" / "memory.json").read_text())
    assert [(v["from"], v["text"]) for v in kept["versions"]] == [(0, MEMORY.strip()), (150, EDITED.strip())]
    ours, ref = read_tokens(w / "edited"), read_tokens(w / "plain")
    changed = next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), None)
    assert changed is not None and changed > 150, changed
