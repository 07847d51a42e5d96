"""The Triton tree-attention kernel (kernels/tree_attention.py) against its torch reference and against the
lean forward's own attention, run by Triton's interpreter on the CPU (TRITON_INTERPRET=1), and the lean
forward with the kernel switched in (--attention triton) giving the same logits and the same text."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: kernels run in numpy on the CPU

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="the tree kernel needs triton (pip install -e '.[test]')")

from swiftwrite.kernels import rms_norm as norm_kernel  # noqa: E402
from swiftwrite.kernels import tree_attention as ta  # noqa: E402
from swiftwrite.models.model import attention, load_lean  # noqa: E402
from swiftwrite.tensors.ops import rms_norm  # noqa: E402
from swiftwrite.decoding.tree import DraftTree  # noqa: E402
from tiny import tiny_hf_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def random_tree(n: int, gen: torch.Generator) -> torch.Tensor:
    """bool [n, n] ancestry of a random tree whose parents precede children (node 0 the root)."""
    anc = torch.eye(n, dtype=torch.bool)
    for i in range(1, n):
        anc[i] |= anc[int(torch.randint(0, i, (1,), generator=gen))]
    return anc


# 64 nodes: ~12 s a dtype through Triton's interpreter, so CI's slow tier runs it and the edit loop the small trees
@pytest.mark.parametrize("H,KV,D,T,n", [pytest.param(4, 2, 16, 37, 5, id="gqa"),
                                        pytest.param(4, 4, 16, 0, 3, id="no-cache"),
                                        pytest.param(6, 2, 32, 130, 64, id="64-nodes", marks=pytest.mark.slow),
                                        pytest.param(2, 1, 16, 200, 1, id="one-node")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_kernel_matches_the_reference(H, KV, D, T, n, dtype):
    g = torch.Generator().manual_seed(H * 100 + T + n)
    q = torch.randn(H, n, D, generator=g).to(dtype)
    kc, vc = (torch.randn(KV, T, D, generator=g).to(dtype) for _ in range(2))
    kt, vt = (torch.randn(KV, n, D, generator=g).to(dtype) for _ in range(2))
    kt = kt.transpose(1, 2).contiguous().transpose(1, 2)  # head dim not contiguous, as RoPE's output can be
    bits = ta.ancestry_bits(random_tree(n, g))
    want = ta.reference(q, kc, vc, kt, vt, bits, D ** -0.5).float()
    got = ta.tree_attention(q, kc, vc, kt, vt, bits, D ** -0.5, block_t=32).float()
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    assert (got - want).abs().max() < tol


def test_reference_equals_the_lean_forwards_masked_attention():
    g = torch.Generator().manual_seed(0)
    H, KV, D, T, n = 6, 2, 16, 50, 9
    q = torch.randn(H, n, D, generator=g)
    k, v = torch.randn(KV, T + n, D, generator=g), torch.randn(KV, T + n, D, generator=g)
    anc = random_tree(n, g)
    mask = torch.cat([torch.ones(n, T, dtype=torch.bool), anc], dim=1)
    lean = attention(q, k, v, mask, 0.25)  # [n, H*D]
    ref = ta.reference(q, k[:, :T], v[:, :T], k[:, T:], v[:, T:], ta.ancestry_bits(anc), 0.25)
    assert torch.allclose(lean, ref.transpose(0, 1).reshape(n, H * D), atol=1e-5)


def test_ancestry_bits_and_their_limit():
    anc = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    assert ta.ancestry_bits(anc).tolist() == [0b001, 0b011, 0b101]
    big = torch.eye(65, dtype=torch.bool)
    with pytest.raises(ValueError, match="64-bit"):
        ta.ancestry_bits(big)
    assert ta.ancestry_bits(torch.ones(64, 64, dtype=torch.bool).tril())[63] == -1  # all 64 bits: int64 -1


def test_the_lean_forward_with_the_kernel_gives_the_same_tree_logits(tmp_path, monkeypatch):
    path, _ = tiny_hf_model("qwen2", out_dir=tmp_path)
    plain = load_lean(path)
    kernel = load_lean(path, attention="triton")
    assert kernel.gpu.tree is not None and plain.gpu.tree is None
    ids = torch.randint(3, 128, (20,), generator=torch.Generator().manual_seed(4))
    tree = DraftTree()
    tree.reset(int(ids[-1]))
    for parent, tok in [(0, 5), (0, 6), (1, 7), (3, 8), (2, 9)]:
        tree.add(parent, tok, 0.5, 0)
    flat = tree.select(5, 8)
    calls = []
    real = ta.tree_attention
    monkeypatch.setattr(ta, "tree_attention", lambda *a, **k: (calls.append(a[0].shape), real(*a, **k))[1])
    out = []
    for model in (plain, kernel):
        cache = model.new_cache(64)
        model.forward(ids[:-1], torch.arange(19), cache)
        cache.length = 19
        out.append(model.forward(flat.tokens, 19 + flat.depth, cache, flat.anc)[0])
    assert torch.allclose(out[0], out[1], atol=1e-4)
    # the kernel ran for the 19-token causal prefill and for the 6-node tree, in every layer
    assert calls == [(4, 19, 16)] * 2 + [(4, 6, 16)] * 2


def test_the_kernel_reads_the_committed_length_from_memory():
    """With `length`, the kernel gets the whole cache buffer and reads only the first `length` slots, the count
    taken from the tensor at run time (what lets a CUDA graph replay one launch at every step)."""
    g = torch.Generator().manual_seed(11)
    H, KV, D, cap, n = 4, 2, 16, 150, 7
    q = torch.randn(H, n, D, generator=g)
    kc, vc = (torch.randn(KV, cap, D, generator=g) for _ in range(2))
    kt, vt = (torch.randn(KV, n, D, generator=g) for _ in range(2))
    bits = ta.ancestry_bits(random_tree(n, g))
    length = torch.zeros(1, dtype=torch.long)
    for T in (0, 1, 63, 64, 65, 149):
        length.fill_(T)
        got = ta.tree_attention(q, kc, vc, kt, vt, bits, 0.25, block_t=32, length=length)
        want = ta.reference(q, kc[:, :T], vc[:, :T], kt, vt, bits, 0.25)
        assert (got - want).abs().max() < 1e-5, T


COMPILE = """
import inspect, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from swiftwrite.kernels import tree_attention as ta

k = ta._tree_attention_kernel
names = list(inspect.signature(k.fn).parameters)
consts = {"GROUP": 3, "D": 64, "BLOCK_T": 64, "MAXN": 64}
for arch in (80, 90):
    for dt in ("fp32", "bf16", "fp16"):
        for len_in_memory in (False, True):
            sig = {n: ("*" + dt if n in ("Q", "KC", "VC", "KT", "VT", "O") else "*i32" if n in ("PATH", "CNT")
                       else "*i64" if n == "LEN"
                       else "fp32" if n == "scale" else "constexpr" if n in (*consts, "LEN_IN_MEMORY") else "i32")
                   for n in names}
            cx = {(names.index(c),): v for c, v in {**consts, "LEN_IN_MEMORY": len_in_memory}.items()}
            out = triton.compile(ASTSource(fn=k, signature=sig, constexprs=cx), target=GPUTarget("cuda", arch, 32))
            assert out.asm["cubin"], (arch, dt)
            print(arch, dt, len_in_memory, "ok")
"""


def test_the_kernel_compiles_to_gpu_code_for_ampere_and_hopper():
    """The interpreter runs the kernel's Python, not Triton's compiler: a kernel can pass every interpreted
    test and still fail to compile for a GPU. Triton compiles to a cubin without a GPU present, so compile it
    here for sm_80 and sm_90, in every dtype, with the cache length passed by value and read from memory."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    proc = subprocess.run([sys.executable, "-c", COMPILE], capture_output=True, text=True, env=env, timeout=600)
    if proc.returncode and "ptxas" in proc.stderr and "not found" in proc.stderr.lower():
        pytest.skip("this triton has no ptxas to compile with")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("ok") == 12


# ---------------------------------------------------------------------------------------------------------
# Exact by construction: a tree node's attention is the bits of a single step (the same kernel, n = 1)


def step_and_tree(dtype, T: int, n: int = 64, seed: int = 0):
    """A random n-node tree after T cached slots (two query heads over one KV head): its inputs, and for every
    node the kernel's result as a single decoding step at its place computes it: one query against the cache
    followed by the node's ancestors, in depth order, as plain decoding would have cached them."""
    g = torch.Generator().manual_seed(seed + T)
    H, KV, D = 2, 1, 16
    anc = random_tree(n, g)
    q = torch.randn(H, n, D, generator=g).to(dtype)
    kc, vc = (torch.randn(KV, T, D, generator=g).to(dtype) for _ in range(2))
    kt, vt = (torch.randn(KV, n, D, generator=g).to(dtype) for _ in range(2))
    steps = []
    one = torch.ones(1, dtype=torch.long)
    for i in range(n):
        before = anc[i].nonzero().flatten()[:-1]
        k, v = torch.cat([kc, kt[:, before]], 1), torch.cat([vc, vt[:, before]], 1)
        steps.append(ta.tree_attention(q[:, i : i + 1], k, v, kt[:, i : i + 1], vt[:, i : i + 1], one, D ** -0.5,
                                       block_t=16)[:, 0])
    return (q, kc, vc, kt, vt, anc), torch.stack(steps, 1)


@pytest.mark.parametrize("T", [15, 16, 17], ids=lambda T: f"cache{T}")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_every_tree_node_gets_the_bits_of_a_single_step_at_any_tree_size(dtype, T):
    """Trees of 1..64 nodes (prefixes of one random tree: each is a tree) after caches that end before, on and
    after a block boundary (blocks of 16; with the nodes' depths the steps' sequences end on every side of the
    next boundaries too): every node's output is bit-equal to the step's. The float32 cases are the strict ones:
    the kernel before this plan (the cache, then the tree as one block of its own) passed the bfloat16 cases, whose
    output rounds most float32 differences away, and failed every float32 case at 2 nodes."""
    (q, kc, vc, kt, vt, anc), steps = step_and_tree(dtype, T)
    for n in (1, 2, 3, 5, 16, 17, 33, 64):
        got = ta.tree_attention(q[:, :n], kc, vc, kt[:, :n], vt[:, :n], ta.ancestry_bits(anc[:n, :n]), 16 ** -0.5,
                                block_t=16)
        differ = [i for i in range(n) if not torch.equal(got[:, i], steps[:, i])]
        assert differ == [], f"{n} nodes: nodes {differ} differ from their single steps"


def test_the_step_comparison_catches_batched_attention_and_another_fold():
    """Negative controls for the test above, on the same inputs: stock scaled-dot-product attention over the
    whole tree (a mask, all rows in one call) and the kernel folding the sequence in other blocks both give
    some node other bits than its step, so bit-equality there is not a property any correct attention has. In
    float32: the kernel sums in float32 either way, and a bfloat16 output rounds most such differences away."""
    (q, kc, vc, kt, vt, anc), steps = step_and_tree(torch.float32, 17)
    n = anc.shape[0]
    mask = torch.cat([torch.ones(n, kc.shape[1], dtype=torch.bool), anc], dim=1)
    stock = torch.nn.functional.scaled_dot_product_attention(
        q.unsqueeze(0), torch.cat([kc, kt], 1).repeat(2, 1, 1).unsqueeze(0),
        torch.cat([vc, vt], 1).repeat(2, 1, 1).unsqueeze(0), attn_mask=mask, scale=16 ** -0.5)[0]
    assert (stock - steps).abs().max() < 1e-5  # the same attention...
    assert not torch.equal(stock, steps)  # ...in other bits
    other = ta.tree_attention(q, kc, vc, kt, vt, ta.ancestry_bits(anc), 16 ** -0.5, block_t=32)
    assert not torch.equal(other, steps)


def test_ancestry_paths_list_each_nodes_path_in_depth_order():
    anc = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    paths, counts = ta.ancestry_paths(ta.ancestry_bits(anc))
    assert counts.tolist() == [1, 2, 2, 3]
    assert [p[:c].tolist() for p, c in zip(paths, counts)] == [[0], [0, 1], [0, 2], [0, 2, 3]]
    chain = torch.ones(64, 64, dtype=torch.bool).tril()  # all 64 bits, the last one the sign bit
    paths, counts = ta.ancestry_paths(ta.ancestry_bits(chain))
    assert counts[63] == 64 and paths[63].tolist() == list(range(64))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
def test_the_norm_kernel_gives_a_row_its_bits_among_any_number_of_rows_and_matches_torch(dtype):
    """kernels/rms_norm.py: one program per row, so a row among n rows is the row alone, bit for bit (the property
    a tree's rows rest on where torch's CUDA reduction changes its order with the count); its values are torch's
    RMSNorm to within the last bit of the dtype; a strided [heads, n, D] input (q/k norms) keeps its shape."""
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(40, 96, generator=g) * 3).to(dtype)
    w = (torch.rand(96, generator=g) + 0.5).to(dtype)
    alone = torch.cat([norm_kernel.rms_norm(r, w, 1e-5) for r in x.split(1)])
    for n in (2, 3, 17, 40):
        assert torch.equal(torch.cat([norm_kernel.rms_norm(p, w, 1e-5) for p in x.split(n)]), alone), n
    want = rms_norm(x, w, 1e-5).float()
    # relative to the value: a unit in the last place is at most 2^-7 of it in bfloat16, 2^-10 in float16, 2^-23 in
    # float32. bfloat16 gets two: Triton's interpreter truncates float32 to bfloat16 (a GPU rounds to nearest even,
    # as asked) and the norm rounds twice. float32: a few, from another order of the sum and another rsqrt
    rel = {torch.bfloat16: 2**-6, torch.float16: 2**-9, torch.float32: 2**-20}[dtype]
    assert ((alone.float() - want).abs() <= rel * want.abs()).all()
    heads = x[:36].view(12, 3, 96)[:, :, :32].transpose(0, 1)  # [3, 12, 32], not contiguous
    y = norm_kernel.rms_norm(heads, w[:32], 1e-5)
    assert y.shape == heads.shape and torch.equal(y, torch.stack([norm_kernel.rms_norm(h.contiguous(), w[:32], 1e-5) for h in heads]))


def test_an_exact_model_with_the_tree_kernel_normalises_with_the_kernel_and_others_with_torch(tmp_path):
    path, _ = tiny_hf_model("llama", out_dir=tmp_path)
    assert load_lean(path, dtype=torch.bfloat16, attention="triton").norm is norm_kernel.rms_norm
    assert load_lean(path, dtype=torch.float32, attention="triton").norm is rms_norm  # float32: not exact_rows
    assert load_lean(path, dtype=torch.bfloat16, attention="torch").norm is rms_norm
