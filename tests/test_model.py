"""The lean forward computes what transformers computes: prefill, single-token decode, tree verification,
hidden states and KV-cache compaction, on tiny random models of every supported architecture, and on the
real default model end to end (greedy output token for token)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from swiftwrite.decoding.budget import SIZES, CostCurve
from swiftwrite.models.model import linear, load_lean
from swiftwrite.tensors.ops import row_plan, row_times
from tiny import tiny_hf_model

ATOL = RTOL = 1e-4  # float32 through 2 layers of width 64: observed differences are ~3e-6
VOCAB = 128  # tiny.BASE vocab_size

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # 64 with head_dim 16: the two longest wavelengths are slowed 8x, one is blended, the rest kept, so
    # positions below 30 already see all three regimes.
    "original_max_position_embeddings": 64,
}

CONFIGS = {
    "llama-gqa": ("llama", {}),  # 4 query heads over 2 KV heads
    "llama-mha": ("llama", {"num_key_value_heads": 4}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "llama3-rope": ("llama", {"rope_parameters": LLAMA3_ROPE}),
    "mistral": ("mistral", {}),
    "qwen2-bias": ("qwen2", {}),
    "qwen2-tied": ("qwen2", {"tie_word_embeddings": True}),
    "qwen3-qknorm": ("qwen3", {}),
    "qwen3-tied-mqa": ("qwen3", {"tie_word_embeddings": True, "num_key_value_heads": 1}),
}

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# A 6-node draft tree: node 0 is the root, 1 and 2 its children, 3 and 4 children of 1, 5 the child of 2.
PARENTS = [-1, 0, 0, 1, 1, 2]


def build(arch: str, overrides: dict, tmp_path_factory, seed: int = 0):
    overrides = {k: dict(v) if isinstance(v, dict) else v for k, v in overrides.items()}  # HF mutates dicts
    path, hf = tiny_hf_model(arch, seed=seed, out_dir=tmp_path_factory.mktemp(arch), **overrides)
    return hf, load_lean(path)


@pytest.fixture(scope="module", params=list(CONFIGS), ids=list(CONFIGS))
def tiny(request, tmp_path_factory):
    arch, overrides = CONFIGS[request.param]
    return build(arch, overrides, tmp_path_factory)


def token_ids(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def hf_logits(hf, ids: torch.Tensor) -> torch.Tensor:
    """Reference: one plain causal forward of the whole sequence, no cache."""
    return hf(ids[None]).logits[0].float()


@torch.no_grad()
def hf_pre_norm_hidden(hf, ids: torch.Tensor) -> torch.Tensor:
    """The last decoder layer's output, i.e. the residual stream before the final norm. Read with a hook:
    `output_hidden_states` in transformers 5 replaces hidden_states[-1] with the post-norm
    last_hidden_state, which is not what the lean forward returns."""
    seen = {}

    def grab(module, args, output):
        seen["h"] = output[0] if isinstance(output, tuple) else output

    handle = hf.model.layers[-1].register_forward_hook(grab)
    try:
        hf(ids[None])
    finally:
        handle.remove()
    return seen["h"][0].float()


def tree_inputs(parents: list[int], start: int, seed: int = 7):
    """Token ids, positions (start + depth) and the ancestor-or-self mask [n, n] of a tree."""
    n = len(parents)
    depth, mask = [], torch.zeros(n, n, dtype=torch.bool)
    for i, p in enumerate(parents):
        depth.append(0 if p < 0 else depth[p] + 1)
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parents[j]
    return token_ids(n, seed), torch.tensor(depth) + start, mask


def path_to(parents: list[int], node: int) -> list[int]:
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def close(actual, expected, atol=ATOL, rtol=RTOL):
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)


# ---------------------------------------------------------------------------------------------------------
# Tiny random models against transformers


def test_prefill_logits_equal_transformers(tiny):
    hf, lean = tiny
    ids = token_ids(12)
    cache = lean.new_cache(32)
    logits, hidden = lean.forward(ids, torch.arange(12), cache)
    assert logits.shape == (12, VOCAB) and logits.dtype == torch.float32
    assert hidden.shape == (12, hf.config.hidden_size)
    assert cache.length == 0  # the caller commits
    close(logits, hf_logits(hf, ids))


def test_incremental_decode_equals_transformers(tiny):
    hf, lean = tiny
    ids = token_ids(16)
    ref = hf_logits(hf, ids)
    cache = lean.new_cache(32)
    logits, _ = lean.forward(ids[:8], torch.arange(8), cache)
    cache.length += 8
    close(logits, ref[:8])
    for t in range(8, 16):
        logits, _ = lean.forward(ids[t : t + 1], torch.tensor([t]), cache)
        cache.length += 1
        close(logits[0], ref[t])


def test_chunked_prefill_equals_transformers(tiny):
    # mask=None with n > 1 after a committed prefix: causal inside the chunk, every cached slot visible.
    hf, lean = tiny
    ids = token_ids(14)
    ref = hf_logits(hf, ids)
    cache = lean.new_cache(32)
    for a, b in [(0, 5), (5, 9), (9, 14)]:
        logits, _ = lean.forward(ids[a:b], torch.arange(a, b), cache)
        cache.length += b - a
        close(logits, ref[a:b])


@pytest.mark.parametrize("mask_width", ["new", "cache+new"])
def test_tree_forward_equals_transformers_on_each_root_to_node_path(tiny, mask_width):
    hf, lean = tiny
    prefix = token_ids(7, seed=3)
    cache = lean.new_cache(32)
    lean.forward(prefix, torch.arange(7), cache)
    cache.length = 7
    tree_ids, positions, mask = tree_inputs(PARENTS, start=7)
    if mask_width == "cache+new":
        mask = torch.cat([torch.ones(len(PARENTS), 7, dtype=torch.bool), mask], dim=1)
    logits, _ = lean.forward(tree_ids, positions, cache, mask=mask)
    assert cache.length == 7
    for node in range(len(PARENTS)):
        seq = torch.cat([prefix, tree_ids[path_to(PARENTS, node)]])
        close(logits[node], hf_logits(hf, seq)[-1])


def test_hidden_is_transformers_residual_stream_before_final_norm(tiny):
    hf, lean = tiny
    ids = token_ids(12)
    cache = lean.new_cache(32)
    lean.forward(ids[:9], torch.arange(9), cache)
    cache.length = 9
    _, hidden = lean.forward(ids[9:], torch.arange(9, 12), cache)
    # The residual stream grows layer by layer; compare relative to its scale.
    ref = hf_pre_norm_hidden(hf, ids)[9:]
    close(hidden, ref, atol=ATOL * float(ref.abs().max()))


def test_logits_for_selects_rows(tiny):
    _, lean = tiny
    ids = token_ids(10)
    full, _ = lean.forward(ids, torch.arange(10), lean.new_cache(16))
    last, _ = lean.forward(ids, torch.arange(10), lean.new_cache(16), logits_for=slice(-1, None))
    picked, _ = lean.forward(ids, torch.arange(10), lean.new_cache(16), logits_for=torch.tensor([2, 7]))
    close(last, full[-1:], atol=1e-5, rtol=1e-5)
    close(picked, full[[2, 7]], atol=1e-5, rtol=1e-5)


def test_comparison_detects_wrong_positions_mask_and_rope_scaling(tmp_path_factory):
    # The equality tests above mean something only if the tiny models are sensitive to what could go wrong.
    hf, lean = build("llama", {"rope_parameters": LLAMA3_ROPE}, tmp_path_factory)
    ids = token_ids(12)
    ref = hf_logits(hf, ids)
    far = 100 * ATOL
    # RoPE sees only relative positions, so shifting all of them changes nothing; move the last token only.
    shifted, _ = lean.forward(ids, torch.tensor(list(range(11)) + [12]), lean.new_cache(16))
    everything = torch.ones(12, 12, dtype=torch.bool)
    unmasked, _ = lean.forward(ids, torch.arange(12), lean.new_cache(16), mask=everything)
    assert (shifted - ref).abs().max() > far
    assert (unmasked - ref).abs().max() > far
    _, plain = build("llama", {}, tmp_path_factory)  # same seed, same weights, unscaled RoPE
    unscaled, _ = plain.forward(ids, torch.arange(12), plain.new_cache(16))
    assert (unscaled - ref).abs().max() > far


# Configuration variants that change the math: biases on o_proj and the MLP are loaded and applied; a
# sliding window caps the model's context at the window (window.py rebuilds the context past it), so every
# forward the lean model accepts is exact.
BIAS_VARIANTS = {
    "llama-attention-bias": ("llama", {"attention_bias": True}),
    "qwen3-attention-bias": ("qwen3", {"attention_bias": True}),
    "llama-mlp-bias": ("llama", {"mlp_bias": True}),
}


@pytest.mark.parametrize("name", list(BIAS_VARIANTS))
def test_bias_variants_equal_transformers(name, tmp_path_factory):
    arch, overrides = BIAS_VARIANTS[name]
    hf, lean = build(arch, overrides, tmp_path_factory)
    ids = token_ids(12)
    logits, _ = lean.forward(ids, torch.arange(12), lean.new_cache(16))
    close(logits, hf_logits(hf, ids))


def test_sliding_window_caps_the_context_and_is_exact_inside_it(tmp_path_factory):
    hf, lean = build("mistral", {"sliding_window": 4}, tmp_path_factory)
    assert lean.cfg.max_positions == 4
    ids = token_ids(4)
    logits, _ = lean.forward(ids, torch.arange(4), lean.new_cache(8))
    close(logits, hf_logits(hf, ids))
    with pytest.raises(RuntimeError):
        lean.forward(token_ids(5), torch.arange(5), lean.new_cache(8))


# ---------------------------------------------------------------------------------------------------------
# KV-cache compaction


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def tiny_for_compact(request, tmp_path_factory):
    return build(request.param, {}, tmp_path_factory, seed=5)


@pytest.mark.parametrize("accepted", [[0, 1, 3], [0, 2, 5], [0, 1, 4], [0]], ids=str)
def test_compacted_tree_path_decodes_like_the_linear_path(tiny_for_compact, accepted):
    hf, lean = tiny_for_compact
    prefix = token_ids(7, seed=3)
    start = len(prefix)
    tree_ids, positions, mask = tree_inputs(PARENTS, start=start)
    bonus = token_ids(1, seed=11)  # the token decoded after the accepted path

    cache = lean.new_cache(32)
    lean.forward(prefix, torch.arange(start), cache)
    cache.length = start
    lean.forward(tree_ids, positions, cache, mask=mask)
    cache.compact(start, torch.tensor(accepted))
    assert cache.length == start + len(accepted)
    after, _ = lean.forward(bonus, torch.tensor([cache.length]), cache)

    linear_ids = torch.cat([prefix, tree_ids[accepted], bonus])
    fresh = lean.new_cache(32)
    lean.forward(linear_ids[:-1], torch.arange(len(linear_ids) - 1), fresh)
    fresh.length = len(linear_ids) - 1
    expected, _ = lean.forward(bonus, torch.tensor([fresh.length]), fresh)

    close(after, expected, atol=1e-5, rtol=1e-5)
    close(after[0], hf_logits(hf, linear_ids)[-1])
    n = fresh.length
    close(cache.k[:, :, :n], fresh.k[:, :, :n], atol=1e-5, rtol=1e-5)
    close(cache.v[:, :, :n], fresh.v[:, :, :n], atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------------------
# The real default model


PROMPT = [{"role": "user", "content": "Write a long, detailed essay about the history of the printing press."}]


@pytest.fixture(scope="module")
def real(default_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_dir)
    hf = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    lean = load_lean(default_model_dir)
    text = tok.apply_chat_template(PROMPT, tokenize=False, add_generation_prompt=True)
    ids = torch.tensor(tok(text, add_special_tokens=False)["input_ids"])
    return hf, lean, ids


@pytest.mark.slow
def test_real_model_prompt_logits_equal_transformers(real):
    hf, lean, ids = real
    logits, _ = lean.forward(ids, torch.arange(len(ids)), lean.new_cache(len(ids)))
    close(logits, hf_logits(hf, ids), atol=1e-3, rtol=1e-4)


@pytest.mark.slow
def test_real_model_greedy_200_tokens_equal_transformers_generate(real):
    hf, lean, ids = real
    n_new = 200
    eos = set(lean.cfg.eos_token_ids)
    with torch.no_grad():
        mask = torch.ones(1, len(ids), dtype=torch.long)
        out = hf.generate(ids[None], attention_mask=mask, do_sample=False, max_new_tokens=n_new)
    expected = out[0, len(ids):].tolist()

    cache = lean.new_cache(len(ids) + n_new)
    logits, _ = lean.forward(ids, torch.arange(len(ids)), cache, logits_for=slice(-1, None))
    cache.length = len(ids)
    got = []
    while True:
        tok = int(logits[-1].argmax())
        got.append(tok)
        if tok in eos or len(got) == n_new:
            break
        logits, _ = lean.forward(torch.tensor([tok]), torch.tensor([cache.length]), cache)
        cache.length += 1
    assert len(got) >= 100, "the prompt should keep the model writing; pick one that does"
    assert got == expected


# A kernel like the one measured on a 2-core AVX2 machine (2026-12-03): fast at multiples of 8, slow between
SAWTOOTH = [0.0] + [(1 + n / 8) * (1.0 if n % 8 == 0 else 2.2) for n in range(1, 65)]


def test_the_row_plan_only_grows_pads_where_a_count_is_clearly_cheaper_and_plans_itself():
    plan = row_plan(SAWTOOTH)
    assert len(plan) == 65 and plan[0] == 0
    for n in range(1, 65):
        m = plan[n]
        assert m >= n and plan[m] == m  # never fewer rows; padding twice changes nothing
        assert m == n or SAWTOOTH[m] < 0.9 * SAWTOOTH[n]  # a pad is a clear gain, not noise
        assert SAWTOOTH[m] <= SAWTOOTH[n]
    assert {plan[n] for n in range(9, 17)} == {16} and plan[8] == 8
    # a flat kernel, or one whose costs only rise with the rows: nothing is padded
    assert row_plan([0.0] + [1.0] * 64) == list(range(65))
    assert row_plan([0.0] + [1.0 + n * 0.01 for n in range(1, 65)]) == list(range(65))


def test_row_times_measures_every_count_and_a_real_plan_is_well_formed():
    torch.manual_seed(0)
    times = row_times([torch.randn(96, 64), torch.randn(200, 64)], upto=20, reps=1)
    assert len(times) == 21 and times[0] == 0.0 and all(t > 0 for t in times[1:])
    plan = row_plan(times)
    assert all(m >= n and plan[m] == m for n, m in enumerate(plan))


def test_zero_padded_product_rows_are_the_rows_alone():
    torch.manual_seed(0)
    w, b = torch.randn(96, 64), torch.randn(96)
    for n in range(2, 34):
        x = torch.randn(n, 64)
        y = linear(x, w, b, grow=row_plan(SAWTOOTH)[n])
        assert y.shape == (n, 96)
        torch.testing.assert_close(y, x @ w.T + b, rtol=1e-5, atol=1e-4)


def test_a_padded_cost_curve_prices_n_tokens_at_the_rows_they_run():
    plan = row_plan(SAWTOOTH)
    c = CostCurve(SIZES, [1.0, 1.2, 1.4, 1.8, 2.4, 4.0, 8.0]).padded(plan)
    for n in range(1, 65):
        assert float(c(n)) == float(np.interp(plan[n], SIZES, c.seconds))
    assert len({float(c(n)) for n in range(9, 17)}) == 1  # 9..16 tokens all run as 16 rows


def test_the_tokenizer_loads_as_autotokenizer_loads_it(default_model_dir, tmp_path):
    """load_tokenizer loads a generic tokenizer class by name, skipping AutoTokenizer's look at the model's
    configuration (2.2 s a run): the same class, ids, special ids and chat template; a tokenizer_config.json that
    names no class still goes through AutoTokenizer, with the same result."""
    import json
    import shutil

    from transformers import AutoTokenizer

    from swiftwrite.models.modelfiles import load_tokenizer

    text = "A keeper's café <|im_start|> at 3:05, naïve\n\n  spaces"
    chat = [{"role": "user", "content": "Write a poem."}]
    want = AutoTokenizer.from_pretrained(str(default_model_dir))
    unnamed = tmp_path / "unnamed"
    unnamed.mkdir()
    for f in default_model_dir.iterdir():
        if f.name.startswith(("tokenizer", "chat_template", "special_tokens", "config")):
            shutil.copy(f, unnamed / f.name)
    settings = json.loads((unnamed / "tokenizer_config.json").read_text())
    assert settings.pop("tokenizer_class") == "TokenizersBackend"  # the store's own conversion names it
    (unnamed / "tokenizer_config.json").write_text(json.dumps(settings))
    for got in (load_tokenizer(default_model_dir), load_tokenizer(unnamed)):
        assert type(got) is type(want)
        assert got(text)["input_ids"] == want(text)["input_ids"]
        assert got.all_special_ids == want.all_special_ids and got.eos_token_id == want.eos_token_id
        assert got.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
            want.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
