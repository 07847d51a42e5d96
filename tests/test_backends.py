"""Choosing the backend (swiftwrite/models/backends.py): what makes llama.cpp impossible is one sentence that says what to do;
`auto` without a working binding runs torch with a notice; `auto` with one times both on this machine once, keeps
the times, and afterwards loads only the faster; a binding that imports but fails is reported, not a traceback."""

from __future__ import annotations

import dataclasses
import sys
import types

import pytest
import torch

from gguf_tiny import write_gguf
from swiftwrite.models import backends, ggmlbinding, ggmlmodel, ggmlprobe
from swiftwrite.base import measurements
from swiftwrite.base.config import Config
from swiftwrite.base.errors import UserError
from swiftwrite.models.model import load_lean, load_lean_layers
from tiny import tiny_hf_model


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("SWIFTWRITE_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture
def gguf_dir(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    write_gguf(d / "model.gguf", vocab=96, tied=True)
    (d / "config.json").write_text("{}")
    return d


@pytest.fixture
def broken_binding(monkeypatch):
    """A llama_cpp that imports but is not the API we call (what an incompatible or broken install looks like)."""
    monkeypatch.setitem(sys.modules, "llama_cpp", types.ModuleType("llama_cpp"))
    monkeypatch.setattr(ggmlbinding, "_binding", None)


def test_a_binding_that_imports_but_fails_is_one_reason_not_a_traceback(broken_binding):
    with pytest.raises(ggmlbinding.BackendMissing, match="AttributeError"):
        ggmlbinding.binding()


@pytest.mark.parametrize("setting, words", [
    (dict(tp=2), "one process"),
    (dict(device="cuda"), "CPU"),
    (dict(weights="int4"), "drop --weights"),
    (dict(dtype="bfloat16"), "drop --dtype"),
    (dict(draft="heads"), "--draft all"),
])
def test_what_llama_cpp_cannot_run_is_a_sentence_naming_what_to_do(gguf_dir, setting, words):
    cfg = Config(backend="ggml", **setting)
    why = backends.why_not_ggml(cfg, gguf_dir, setting.get("device", "cpu"))
    assert words in why and why.endswith(".")
    with pytest.raises(UserError, match="backend torch"):
        backends.choose(cfg, gguf_dir, setting.get("device", "cpu"))
    assert backends.choose(Config(backend="auto", **setting), gguf_dir, setting.get("device", "cpu")) == "torch"


def test_a_model_without_a_gguf_runs_torch_and_ggml_says_why(tmp_path):
    assert "no GGUF" in backends.why_not_ggml(Config(backend="ggml"), tmp_path, "cpu")
    assert backends.choose(Config(backend="auto"), tmp_path, "cpu") == "torch"


def test_auto_without_a_working_binding_runs_torch_with_one_notice(gguf_dir, broken_binding):
    said = []
    assert backends.choose(Config(backend="auto"), gguf_dir, "cpu", said.append) == "torch"
    assert len(said) == 1 and "pip install 'swiftwrite[ggml]'" in said[0]
    with pytest.raises(UserError, match="needs llama-cpp-python"):
        backends.choose(Config(backend="ggml"), gguf_dir, "cpu")


def test_auto_times_each_once_keeps_the_times_and_then_loads_only_the_faster(gguf_dir, tmp_path, home):
    pytest.importorskip("llama_cpp")
    from test_ggml import tiny_config

    torch_dir, _ = tiny_hf_model("llama", out_dir=tmp_path / "torch")
    loads, opened, priced = {"torch": 0, "ggml": 0, "ggml-repacked": 0}, [], []

    def load_torch():
        loads["torch"] += 1
        return load_lean(torch_dir)

    def price_torch():
        assert all(m.handle is None for m in opened), "one backend's weights at a time: llama.cpp's model is closed"
        priced.append(1)
        return backends.torch_step_ms(lambda k: load_lean_layers(torch_dir, k), 2)

    def load_ggml(name):
        loads[name] += 1
        loading = ggmlmodel.REPACKED if name == "ggml-repacked" else ggmlmodel.INVARIANT
        opened.append(ggmlmodel.GgmlModel(gguf_dir / "model.gguf", tiny_config(), threads=1, loading=loading))
        return opened[-1]

    said = []
    name, model = backends.measured(gguf_dir, 1, load_torch, load_ggml, price_torch, said.append)
    # llama.cpp's loadings timed one after the other, torch priced; then only the winner is loaded (again)
    assert priced == [1] and loads == {"torch": int(name == "torch"), "ggml": 1 + (name == "ggml"),
                                       "ggml-repacked": 1 + (name == "ggml-repacked")}
    times = next(v for k, v in measurements.read(backends._path()).items() if "/rows" not in k)
    assert set(times) == {"torch", "ggml", "ggml-repacked"} and name == backends._fastest(times)
    assert model.__class__.__name__ == ("LeanModel" if name == "torch" else "GgmlModel")
    assert len(said) == 1 and said[0].startswith(f"backend: {name}")
    before = dict(loads)
    again, _ = backends.measured(gguf_dir, 1, load_torch, load_ggml, price_torch)
    assert again == name and priced == [1] and loads == {**before, name: before[name] + 1}  # nothing else loaded


def test_torch_is_priced_on_the_line_through_its_first_layer_and_its_first_eight(monkeypatch):
    """A step's cost is a fixed part (embedding, LM head) plus one part per layer: the price of the whole model is
    that line at its layer count, from models of no more than PRICED_LAYERS layers; a small model is timed whole."""
    built = []
    monkeypatch.setattr(backends, "step_ms", lambda model: 5.0 + 0.75 * model)

    def layers(k):
        built.append(k)
        return k  # step_ms above reads the layer count

    assert backends.torch_step_ms(layers, 32) == pytest.approx(5.0 + 0.75 * 32)
    assert sorted(built) == [1, backends.PRICED_LAYERS]
    built.clear()
    assert backends.torch_step_ms(layers, 3) == pytest.approx(5.0 + 0.75 * 3) and built == [3]


@pytest.mark.parametrize("weights", ["float", "int8"])
def test_a_model_cut_to_all_its_layers_computes_what_the_whole_model_computes(tmp_path, home, weights):
    """What auto times is the lean forward itself: cut to every layer it is the model that runs (the int8 products
    quantized in memory equal the stored ones), and cut shorter it has that many layers."""
    d, _ = tiny_hf_model("llama", out_dir=tmp_path / "m")
    whole, cut, short = load_lean(d, weights=weights), load_lean_layers(d, 2, weights=weights), load_lean_layers(d, 1)
    ids = torch.arange(7)
    logits = []
    for model in (whole, cut):
        cache = model.new_cache(8)
        logits.append(model.forward(ids, torch.arange(7), cache)[0])
    assert whole.cfg.n_layers == 2 and len(short.layers) == 1
    assert torch.equal(logits[0], logits[1])


def test_loading_probes_once_per_build_keeps_the_finding_and_loads_as_it_found(gguf_dir, home):
    """The first load probes the invariant loading and keeps what it found; the next loads that loading with the
    kept finding and probes nothing."""
    pytest.importorskip("llama_cpp")
    from test_ggml import tiny_config

    cfg = dataclasses.replace(tiny_config(), max_positions=2048)
    first = backends.load_ggml(gguf_dir, cfg, 2)
    assert first.loading == ggmlmodel.INVARIANT and first.found.invariant and first.abilities.governed
    first.close()
    with pytest.MonkeyPatch.context() as m:
        m.setattr(ggmlprobe, "probe", lambda model: pytest.fail("probed again"))
        again = backends.load_ggml(gguf_dir, cfg, 2)
    assert again.loading == ggmlmodel.INVARIANT and again.found == first.found
    again.close()


def test_a_binding_built_with_llamafile_loads_stock_and_names_the_rebuild_in_one_sentence(gguf_dir, home,
                                                                                         monkeypatch):
    """llamafile's tiles give a batch's rows other bits than single steps: such a binding is loaded with llama.cpp's
    fast paths (flash attention), where two threads part single steps from batches at long contexts; drafting and
    the governor are off, and the reason names the command that rebuilds the binding."""
    pytest.importorskip("llama_cpp")
    from test_ggml import tiny_config

    info = ggmlbinding.system_info()
    monkeypatch.setattr(ggmlbinding, "system_info", lambda: info + " LLAMAFILE = 1 |")
    model = backends.load_ggml(gguf_dir, dataclasses.replace(tiny_config(), max_positions=2048), 2)
    able = model.abilities
    model.close()
    assert model.loading == ggmlmodel.STOCK and able.steps_apart and not able.governed
    assert ggmlbinding.REBUILD in able.not_exact and able.not_exact.count(". ") == 0


def test_auto_takes_the_repacked_loading_only_where_it_is_clearly_faster():
    """Repacked weights give up trees: auto takes them over the invariant loading only at REPACKED_FASTER or below
    (an 8B-shaped Q4_0: 0.68; the default Q4_1 model: 0.93-1.0, a tie), and torch wherever it is the fastest."""
    fastest = backends._fastest
    assert fastest({"ggml": 10.0, "ggml-repacked": 9.0, "torch": 20.0}) == "ggml"
    assert fastest({"ggml": 10.0, "ggml-repacked": 6.8, "torch": 20.0}) == "ggml-repacked"
    assert fastest({"ggml": 10.0, "ggml-repacked": 6.8, "torch": 5.0}) == "torch"
    assert fastest({"ggml": 10.0, "torch": 12.0}) == "ggml"  # times kept before the repacked loading was a candidate


def test_repacked_weights_load_without_trees_and_their_finding_is_kept_apart(gguf_dir, home, monkeypatch):
    """--backend ggml-repacked: batches part from single steps (a GEMM from 4 rows), so no trees and prefills in
    whole batches, exact by the engine's replay; threads keep the bits, so the governor steers it. Its finding is
    kept beside the invariant loading's, and the next load probes nothing."""
    pytest.importorskip("llama_cpp")
    from test_ggml import tiny_config

    cfg = dataclasses.replace(tiny_config(), max_positions=2048)
    first = backends.load_ggml(gguf_dir, cfg, 2, backend="ggml-repacked")
    able, found = first.abilities, first.found
    first.close()
    assert first.loading == ggmlmodel.REPACKED and found.steps_apart and found.batch_rows > 1
    assert able.max_rows == 1 and able.governed and "batch" in able.not_exact
    invariant = backends.load_ggml(gguf_dir, cfg, 2)  # its own finding, probed now
    invariant.close()
    assert invariant.loading == ggmlmodel.INVARIANT and invariant.found.invariant
    monkeypatch.setattr(ggmlprobe, "probe", lambda model, trees=True: pytest.fail("probed again"))
    again = backends.load_ggml(gguf_dir, cfg, 2, backend="ggml-repacked")
    again.close()
    assert again.loading == ggmlmodel.REPACKED and again.found == found


def test_the_cpu_extensions_are_named():
    ext = backends.cpu_extensions()
    assert ext and all(isinstance(e, str) for e in ext)
    flags = open("/proc/cpuinfo").read() if sys.platform == "linux" else ""
    if " avx2 " in flags:
        assert "AVX2" in ext
