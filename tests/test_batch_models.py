"""A batch keeps one model while its documents' settings resolve to the same model part (records.ModelPart) and
opens another when they do not: over every option the part is resolved from, documents that alternate between two
values of it each get the model their settings open alone. The options come from ModelPart itself, so one added
there later is covered here without a list to update (a value to try must be named below, or this test fails)."""

from __future__ import annotations

import pytest

from swiftwrite.base.config import Config
from swiftwrite.base.errors import UserError
from swiftwrite.io.ui import Display
from swiftwrite.run.assembly import open_model
from swiftwrite.run.records import MODEL_OPTIONS, ModelPart
from swiftwrite.batch.workers import Models
from test_heads import add_byte_tokenizer
from tiny import tiny_hf_model

# two values of each option the part is resolved from that this CPU machine can open (a value refused here, such as
# int4 on a model whose shapes the kernel cannot pack, is skipped)
VALUES = {"device": ("cpu", "auto"), "dtype": ("float32", "bfloat16"), "weights": ("float", "int8"),
          "backend": ("auto", "torch"), "threads": (0, 1), "attention": ("torch", "auto"),
          "cuda_graphs": (False, True), "tp": (1,)}


@pytest.fixture(scope="module")
def two_models(tmp_path_factory):
    d = tmp_path_factory.mktemp("models")
    paths = [tiny_hf_model("llama", seed=s, out_dir=d / f"m{s}", vocab_size=256)[0] for s in (0, 1)]
    for p in paths:
        add_byte_tokenizer(p)  # byte-level: 256 ids
    return [str(p) for p in paths]


def test_every_option_of_the_model_part_has_values_to_try():
    assert MODEL_OPTIONS[0] == "model" and len(MODEL_OPTIONS) == len(ModelPart.__dataclass_fields__)
    missing = [o for o in MODEL_OPTIONS[1:] if o not in VALUES]
    assert not missing, f"name two values of {missing} in VALUES: the batch's model cache keys on them"


@pytest.mark.parametrize("option", MODEL_OPTIONS)
def test_documents_that_differ_in_a_model_option_each_get_their_own_model(two_models, option):
    values = two_models if option == "model" else VALUES[option]
    cfgs, parts = [], []
    for v in values:
        base = {"model": two_models[0]} if option != "model" else {}
        try:
            cfg = Config(**base, **{option: v}).validate()
            parts.append(open_model(cfg, Display("quiet")).part)  # what the document's settings open alone
        except UserError:
            continue  # not something this machine opens
        cfgs.append(cfg)
    assert cfgs, f"no value of {option} opens here"
    models = Models(Display("quiet"))
    for i in [*range(len(cfgs)), 0]:  # there and back: the cache must replace and replace again
        assert models(cfgs[i]).part == parts[i]
    if option == "model":
        assert len(set(parts)) == 2  # two models: two fingerprints
