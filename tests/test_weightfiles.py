"""A GGUF stays a GGUF in the store: its tensors, read one at a time, are exactly what transformers' import holds;
quantized settings build from it without a float copy; float runs write one, once, and nothing else changes."""

import json
from pathlib import Path

import pytest
import torch

from gguf_tiny import write_gguf
from swiftwrite.tensors import quant, weightfiles
from swiftwrite.models import store
from swiftwrite.base.errors import UserError
from swiftwrite.models.model import ModelConfig, load_lean


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("SWIFTWRITE_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def transformers_tensors(gguf: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    return hf.state_dict()


@pytest.mark.parametrize("tied", [False, True])
def test_every_tensor_equals_transformers_import_of_the_same_file(tmp_path, tied):
    """Q4_0, Q4_1, Q8_0, F16 and F32 tensors, q/k projections with 4 query and 2 key/value heads (llama.cpp's
    rotary row order undone): bit for bit what transformers' GGUF loader makes of them."""
    gguf = write_gguf(tmp_path / "m.gguf", tied=tied)
    want = transformers_tensors(gguf)
    got = weightfiles.GGUFWeights(gguf)
    assert set(got.keys()) == set(want) - ({"lm_head.weight"} if tied else set())
    for name in got.keys():
        assert got[name].dtype == torch.float32
        assert torch.equal(got[name], want[name]), name


def test_the_name_map_covers_the_lean_family_and_nothing_else():
    assert weightfiles.hf_name("blk.3.attn_k.weight") == "model.layers.3.self_attn.k_proj.weight"
    assert weightfiles.hf_name("blk.0.attn_q.bias") == "model.layers.0.self_attn.q_proj.bias"
    assert weightfiles.hf_name("blk.1.attn_q_norm.weight") == "model.layers.1.self_attn.q_norm.weight"
    assert weightfiles.hf_name("output.weight") == "lm_head.weight"
    assert weightfiles.hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert weightfiles.hf_name("blk.0.ffn_gate_exps.weight") is None  # a mixture of experts: not the lean family


def test_an_import_keeps_the_gguf_and_writes_no_float_weights(tmp_path, home):
    gguf = write_gguf(tmp_path / "m.gguf")
    ref = store.resolve(str(gguf))
    d = ref.path
    assert (d / weightfiles.GGUF_FILE).read_bytes() == gguf.read_bytes()
    assert not list(d.glob("*.safetensors"))
    assert json.loads((d / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    assert store.resolve(str(gguf)).fingerprint == ref.fingerprint  # found again, not imported twice


def test_quantized_weights_build_from_the_gguf_without_a_float_copy(tmp_path, home):
    """int8 and int4 straight from the GGUF, a layer at a time, equal the same settings built from the float
    weights whole; the store still holds no float copy afterwards."""
    d = store.resolve(str(write_gguf(tmp_path / "m.gguf"))).path
    cfg = ModelConfig.from_hf(json.loads((d / "config.json").read_text()))
    whole = weightfiles.load_all(weightfiles.GGUFWeights(d / weightfiles.GGUF_FILE))
    for setting in ("int8", "int4"):
        lazily = quant.quantize(weightfiles.open_weights(d), cfg, setting)
        at_once = quant.quantize(whole, cfg, setting)
        assert lazily.keys() == at_once.keys()
        for key in lazily:
            for name, t in lazily[key].tensors(key).items():
                assert torch.equal(t, at_once[key].tensors(key)[name]), name
        load_lean(d, weights=setting)
    assert not list(d.glob("*.safetensors"))


def test_a_float_run_writes_the_float_copy_once_and_the_model_stays_the_same(tmp_path, home):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    gguf = write_gguf(tmp_path / "m.gguf")
    d = store.resolve(str(gguf)).path
    fp = store.fingerprint(d)
    logs = []
    first = load_lean(d, log=logs.append)
    assert (d / "model.safetensors").is_file() and any("float32 copy" in m for m in logs)
    logs.clear()
    second = load_lean(d, log=logs.append)  # now read from the copy
    assert not logs
    assert store.fingerprint(d) == fp  # runs and quantized files made before the copy still match
    ids = torch.tensor([1, 5, 9, 20, 33, 60, 2])
    hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf(ids[None]).logits[0]
    for model in (first, second):
        got, _ = model.forward(ids, torch.arange(len(ids)), model.new_cache(16))
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    tensors = hf.state_dict()
    for name, t in load_file(d / "model.safetensors").items():
        assert torch.equal(t, tensors[name]), name


def test_a_store_that_cannot_take_the_float_copy_still_runs(tmp_path, home, monkeypatch):
    import tempfile

    d = store.resolve(str(write_gguf(tmp_path / "m.gguf"))).path
    logs = []

    def refused(*a, **k):  # a read-only store (chmod does not stop root, which these tests may run as)
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(tempfile, "mkstemp", refused)
    load_lean(d, log=logs.append)
    assert not list(d.glob("*.safetensors"))
    assert any("could not be written" in m for m in logs)


def test_a_gguf_tensor_outside_the_family_is_refused_by_name(tmp_path):
    import numpy as np
    from gguf import GGUFWriter

    path = tmp_path / "moe.gguf"
    w = GGUFWriter(str(path), "llama")
    w.add_tensor("blk.0.ffn_gate_exps.weight", np.ones((2, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UserError, match="ffn_gate_exps"):
        weightfiles.GGUFWeights(path)


def test_the_default_model_reads_as_transformers_reads_it(default_model_dir):
    """The real file: every tensor of the default model's Q4_1 GGUF, de-quantized here, equals the float store
    (which the first float use wrote) and transformers' own import of the GGUF."""
    gguf = Path(default_model_dir) / weightfiles.GGUF_FILE
    if not gguf.is_file():
        pytest.skip("this store's default model was imported before GGUFs were kept")
    from safetensors.torch import load_file

    got = weightfiles.GGUFWeights(gguf)
    want = transformers_tensors(gguf)
    copy = load_file(Path(default_model_dir) / "model.safetensors")
    assert set(got.keys()) == set(copy)
    for name in got.keys():
        t = got[name]
        assert torch.equal(t, want[name]) and torch.equal(t, copy[name]), name


def test_auto_runs_a_gguf_on_its_own_bits_when_its_float_weights_do_not_fit(tmp_path, home, monkeypatch):
    """An 8B Q4 GGUF on a 24 GB machine: float32 cannot load, so `--weights auto` takes the GGUF's own bits and
    says why; with room for float32 it stays float (README "Quantized weights"), naming the faster setting."""
    from swiftwrite.run import assembly
    from swiftwrite.base.config import Config
    from swiftwrite.io.ui import Display

    gguf = write_gguf(tmp_path / "m.gguf")
    assert store.gguf_weight_type(gguf) == "Q4_0"
    monkeypatch.setattr(assembly, "free_memory", lambda device: 1 << 40)
    roomy = assembly.open_model(Config(model=str(gguf)), Display("quiet"))
    assert roomy.weights == "float" and "--weights int4" in roomy.weights_note
    monkeypatch.setattr(assembly, "free_memory", lambda device: 100_000)  # less than the tiny model's float32
    tight = assembly.open_model(Config(model=str(gguf)), Display("quiet"))
    assert tight.weights == "int4" and "do not fit" in tight.weights_note
    asked = assembly.open_model(Config(model=str(gguf), weights="float"), Display("quiet"))
    assert asked.weights == "float"
