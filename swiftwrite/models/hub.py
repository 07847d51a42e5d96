"""Models pulled by name from the Hugging Face Hub, as llama.cpp's `-hf user/repo[:QUANT]` and Ollama's `pull` do.

Every request goes through huggingface_hub: the repository's listing (`HfApi.model_info` with the files' sizes and
LFS sha256), each file's URL, metadata, headers and token (`hf_hub_url`, `get_hf_file_metadata`,
`build_hf_headers`), its HTTP session and its error classes; HF_ENDPOINT, HF_TOKEN, HF_HOME / HF_HUB_CACHE and
HF_HUB_OFFLINE mean what they mean to it. Files land in its cache, in its layout (`blobs/<etag>`,
`snapshots/<commit>/<file>` linking to the blob, `refs/main`), so a file another tool downloaded is found and a
file pulled here serves other tools.

One thing is our own: the download itself. huggingface_hub 2.x writes each download to a file named per process
(`<etag>.<uuid>.incomplete`, its PR #4228) and deletes it when the process fails, so an interrupted 5 GB pull starts
again from zero. Ours keeps `blobs/<etag>.incomplete` (the name older huggingface_hub releases resumed from) under
huggingface_hub's own lock for that blob, writes every chunk as it arrives, and continues it with a range request
the next time; the blob appears under its final name only once its size and SHA-256 match the Hub's record, so a
half-downloaded file is never taken for a model.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import huggingface_hub as hf
from huggingface_hub import errors as hf_errors
from huggingface_hub.file_download import repo_folder_name
from huggingface_hub.utils import WeakFileLock, build_hf_headers, get_session, hf_raise_for_status
from tqdm import tqdm

from .. import __version__
from ..base.errors import UsageError, UserError, first_line
from .names import DEFAULT_QUANT, HubName, parse  # noqa: F401 (hub.HubName, hub.parse: read as the Hub's names)

TIMEOUT_S = 8.0  # per request before "cannot be reached": the whole refusal stays within 10 s
ENDPOINT = "https://huggingface.co"

# a GGUF's quantization, by convention the last part of its name: "…-Q4_K_M.gguf", "….Q8_0.gguf", "…-bf16.gguf"
_QUANT_IN_NAME = re.compile(r"(?:^|[-._])((?:I?Q\d(?:_[A-Z0-9]+)*)|F16|BF16|F32|TQ\d_\d|MXFP4(?:_MOE)?)$", re.I)
_SPLIT = re.compile(r"-(\d{5})-of-(\d{5})$")
# a safetensors checkpoint: what transformers and the lean forward read, nothing else (no .bin, no GGUF, no ONNX)
_CHECKPOINT_FILES = re.compile(r"(config\.json|generation_config\.json|tokenizer(_config)?\.json|tokenizer\.model|"
                               r"special_tokens_map\.json|vocab\.json|merges\.txt|chat_template\.jinja|"
                               r"model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json)")


# ---------------------------------------------------------------------------------------------------------
# Names of files (a repository's own name, user/repo[:QUANT], is read in names.py)


def quant_of(filename: str) -> str | None:
    """The quantization a GGUF's file name declares ("Q4_K_M"), upper case; None when it declares none."""
    stem = _SPLIT.sub("", Path(filename).name[: -len(".gguf")] if filename.endswith(".gguf") else Path(filename).stem)
    m = _QUANT_IN_NAME.search(stem)
    return m.group(1).upper() if m else None


# ---------------------------------------------------------------------------------------------------------
# Where: the endpoint, the cache, the token (read at each call: the environment may change in a process)


def endpoint() -> str:
    return (os.environ.get("HF_ENDPOINT") or ENDPOINT).rstrip("/")


def cache_dir() -> Path:
    hub = os.environ.get("HF_HUB_CACHE")
    if hub:
        return Path(hub).expanduser()
    return Path(os.environ.get("HF_HOME") or Path.home() / ".cache" / "huggingface").expanduser() / "hub"


def offline() -> bool:
    return any(os.environ.get(v, "").upper() in ("1", "ON", "YES", "TRUE")
               for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))  # as huggingface_hub reads them


def _token() -> str | None:
    return os.environ.get("HF_TOKEN") or None  # None: huggingface_hub's own (`hf auth login`)


def repo_dir(repo: str) -> Path:
    return cache_dir() / repo_folder_name(repo_id=repo, repo_type="model")


# ---------------------------------------------------------------------------------------------------------
# The listing and the choice of files


@dataclass(frozen=True)
class HubFile:
    name: str
    size: int
    sha256: str | None  # the LFS record; None for a small file kept in git (checked by its git blob id)
    blob_id: str | None


@dataclass(frozen=True)
class Listing:
    repo: str
    commit: str
    files: tuple[HubFile, ...]


@dataclass(frozen=True)
class Choice:
    kind: str  # "gguf" or "checkpoint"
    files: tuple[HubFile, ...]  # a split GGUF's parts in order; a checkpoint's weights first, config.json last
    quant: str | None

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files)


def listing(repo: str) -> Listing:
    """The repository's files with sizes and LFS sha256, at its current commit."""
    if offline():
        raise UserError(f"{repo} is not here and HF_HUB_OFFLINE is set; pull it once with the network, or run a "
                        "model that is here (`swiftwrite models list`).")
    with hub_errors(repo):
        info = hf.HfApi(endpoint=endpoint(), token=_token(), library_name="swiftwrite",
                        library_version=__version__).model_info(repo, files_metadata=True, timeout=TIMEOUT_S)
    files = tuple(HubFile(s.rfilename, int(s.size or (s.lfs.size if s.lfs else 0) or 0),
                          s.lfs.sha256 if s.lfs else None, s.blob_id) for s in info.siblings or ())
    return Listing(repo, info.sha, files)


def choose(lst: Listing, quant: str | None, checkpoint: bool = False) -> Choice:
    """What a pull of `lst.repo[:quant]` downloads. A GGUF repository: the file of `quant` (DEFAULT_QUANT when None,
    else the only GGUF), every part of a split one; a safetensors repository (or `checkpoint`): config, tokenizer
    and weights only."""
    ggufs = [f for f in lst.files if f.name.endswith(".gguf") and "mmproj" not in Path(f.name).name.lower()]
    if ggufs and not checkpoint:
        by_quant: dict[str, list[HubFile]] = {}
        for f in sorted(ggufs, key=lambda f: f.name):
            by_quant.setdefault(quant_of(f.name) or Path(f.name).name, []).append(f)
        want = quant or DEFAULT_QUANT
        if want in by_quant:
            return Choice("gguf", _first_split(by_quant[want]), want)
        if quant is None and len(by_quant) == 1:
            (only, files), = by_quant.items()
            return Choice("gguf", _first_split(files), quant_of(files[0].name))
        raise UserError(f"{lst.repo} has no {want} GGUF; it has {', '.join(sorted(by_quant))}: pull "
                        f"{lst.repo}:{sorted(by_quant)[0]} (or another of those).")
    if quant is not None:
        raise UserError(f"{lst.repo} has no GGUF files, so :{quant} names nothing there; pull {lst.repo} for its "
                        f"safetensors checkpoint.")
    picked = [f for f in lst.files if _CHECKPOINT_FILES.fullmatch(f.name)]
    if not any(f.name.endswith(".safetensors") for f in picked) or not any(f.name == "config.json" for f in picked):
        raise UserError(f"{lst.repo} has neither GGUF files nor a safetensors checkpoint with a config.json; "
                        f"swiftwrite runs those two.")
    # config.json last: a snapshot with it is taken for a model (store._hf_cache_dir), so it must come last
    return Choice("checkpoint", tuple(sorted(picked, key=lambda f: (f.name == "config.json", -f.size))), None)


def _first_split(files: list[HubFile]) -> tuple[HubFile, ...]:
    """One GGUF, or one split GGUF's parts (`-00001-of-0000N`, all of them); files of the same quant in several
    folders or splits: the first group by name."""
    groups: dict[str, list[HubFile]] = {}
    for f in files:
        groups.setdefault(_SPLIT.sub("", f.name[:-5]), []).append(f)
    first = groups[sorted(groups)[0]]
    m = _SPLIT.search(first[0].name[:-5])
    if m and len(first) != int(m.group(2)):
        raise UserError(f"{first[0].name} is one of {int(m.group(2))} parts but the repository lists {len(first)}; "
                        "it cannot be pulled whole.")
    return tuple(first)


# ---------------------------------------------------------------------------------------------------------
# Errors: one sentence each


class hub_errors:
    """huggingface_hub's and the network's exceptions as one sentence each (a context manager)."""

    def __init__(self, repo: str, file: str | None = None):
        self.repo, self.file = repo, file

    def __enter__(self):
        return self

    def __exit__(self, kind, e, tb):
        if e is None or isinstance(e, (UserError, KeyboardInterrupt)) or not isinstance(e, Exception):
            return False
        raise UserError(self.sentence(e)) from None

    def sentence(self, e: Exception) -> str:
        page = f"{endpoint()}/{self.repo}"
        status = getattr(getattr(e, "response", None), "status_code", None)
        what = f"{self.file} from {self.repo}" if self.file else self.repo
        if status == 401 and "Invalid credentials" in str(e):
            return (f"the Hub refused the token for {self.repo} (401, invalid credentials): set HF_TOKEN to a valid "
                    f"token (or run `hf auth login` again), then pull again.")
        if isinstance(e, hf_errors.GatedRepoError) or status in (401, 403):
            return (f"{self.repo} is gated or private and this machine has no access to it ({status}): accept its "
                    f"terms on {page} with your account, then set HF_TOKEN to a token of it (or run `hf auth login`) "
                    "and pull again.")
        if isinstance(e, hf_errors.RepositoryNotFoundError) or (status == 404 and not self.file):
            return f"there is no model repository {self.repo} on {endpoint()}; check the name ({page})."
        if isinstance(e, (hf_errors.EntryNotFoundError, hf_errors.RevisionNotFoundError)) or status == 404:
            return f"{what} is no longer on {endpoint()} ({status}); pull again to list the repository anew."
        if isinstance(e, hf_errors.OfflineModeIsEnabled):
            return (f"{what} is not here and HF_HUB_OFFLINE is set; pull it once with the network, or run a model "
                    "that is here (`swiftwrite models list`).")
        if isinstance(e, hf_errors.HfHubHTTPError) and status is not None:
            return f"the Hub answered {status} for {what} ({first_line(e, 80)}); try again later."
        why = first_line(e, 100) or type(e).__name__
        return (f"the Hugging Face Hub ({endpoint()}) cannot be reached for {what} ({why}); connect to the network "
                "(or set HF_ENDPOINT to a mirror), or run a model that is here (`swiftwrite models list`).")


# ---------------------------------------------------------------------------------------------------------
# Disk


def free_bytes(path: Path) -> int:
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def check_disk(need: int, where: Path, what: str) -> None:
    free = free_bytes(where)
    if need > free:
        raise UserError(f"{what} needs {_gb(need)} free in {where}, and {_gb(free)} is free there; free space, or set "
                        "HF_HOME to a disk with room.")


def _gb(n: int) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


# ---------------------------------------------------------------------------------------------------------
# Download into huggingface_hub's cache, resumable across processes


def pointer(repo: str, commit: str, name: str) -> Path:
    return repo_dir(repo) / "snapshots" / commit / name


def missing(lst: Listing, choice: Choice) -> int:
    """Bytes still to download: files not in the cache, less what partial files already hold."""
    need = 0
    for f in choice.files:
        if pointer(lst.repo, lst.commit, f.name).exists():
            continue
        part = _partial(lst.repo, f)
        need += f.size - (part.stat().st_size if part is not None and part.is_file() else 0)
    return max(need, 0)


def _partial(repo: str, f: HubFile) -> Path | None:
    etag = f.sha256 or f.blob_id  # the Hub's ETag of an LFS file is its sha256, of a git file its blob id
    return repo_dir(repo) / "blobs" / f"{etag}.incomplete" if etag else None


def metadata(repo: str, commit: str, f: HubFile) -> "hf.HfFileMetadata":
    """The file's ETag, size and location (a HEAD request; where the Hub redirects to a CDN, its signed URL)."""
    url = hf.hf_hub_url(repo, f.name, revision=commit, endpoint=endpoint())
    with hub_errors(repo, f.name):
        return hf.get_hf_file_metadata(url, token=_token(), timeout=TIMEOUT_S, endpoint=endpoint(),
                                       library_name="swiftwrite", library_version=__version__)


def fetch(repo: str, commit: str, f: HubFile) -> Path:
    """One file into huggingface_hub's cache: found there, or downloaded (continuing a partial file), checked
    against the listing's size and SHA-256, then placed as huggingface_hub places it."""
    dest = pointer(repo, commit, f.name)
    if dest.exists():
        return dest
    url = hf.hf_hub_url(repo, f.name, revision=commit, endpoint=endpoint())
    headers = build_hf_headers(token=_token(), library_name="swiftwrite", library_version=__version__)
    meta = metadata(repo, commit, f)
    if not meta.etag:
        raise UserError(f"{endpoint()} sent no ETag for {f.name}; HF_ENDPOINT must point at a Hugging Face Hub.")
    size = meta.size if meta.size is not None else f.size
    storage = repo_dir(repo)
    blob = storage / "blobs" / meta.etag
    lock = cache_dir() / ".locks" / storage.name / f"{meta.etag}.lock"
    try:
        blob.parent.mkdir(parents=True, exist_ok=True)
        lock.parent.mkdir(parents=True, exist_ok=True)
        with WeakFileLock(lock):  # huggingface_hub's own lock for this blob: its downloads of it wait for ours
            if not blob.is_file():
                if urlparse(meta.location).netloc != urlparse(url).netloc:
                    headers.pop("authorization", None)  # a CDN's signed URL: the token stays with the Hub
                _continue(meta.location, headers, blob, size, f, repo)
            _place(storage, blob, dest, commit)
    except OSError as e:
        if isinstance(e, hf_errors.HfHubHTTPError):
            raise UserError(hub_errors(repo, f.name).sentence(e)) from None
        raise UserError(f"writing {f.name} into {storage} failed ({e.strerror or e}); free space or set HF_HOME to "
                        "a writable disk.") from None
    return dest


def _continue(url: str, headers: dict, blob: Path, size: int, f: HubFile, repo: str) -> None:
    """Download `url` into blob's `.incomplete` file from the bytes it already holds, then check and rename it."""
    part = blob.with_name(blob.name + ".incomplete")
    done = part.stat().st_size if part.is_file() else 0
    if done > size:  # not this file's bytes (another file under the same name): start over
        part.unlink()
        done = 0
    if done < size:
        _get_range(url, headers, part, done, size, f.name, repo)
    got = part.stat().st_size
    if got != size:
        raise UserError(f"{f.name} from {repo} has {got} bytes, the Hub says {size}; pull again.")
    if not _matches(part, f):
        part.unlink()
        raise UserError(f"{f.name} from {repo} does not match the Hub's SHA-256 record, so it was deleted; pull again "
                        "(if it happens again, the mirror or proxy serves another file).")
    os.replace(part, blob)


def _get_range(url: str, headers: dict, part: Path, done: int, size: int, name: str, repo: str) -> None:
    """GET the bytes from `done` on (a range request when done > 0) with huggingface_hub's session, appending
    each chunk as it arrives: a kill loses what the kernel was not given yet, never what is on disk."""
    asked = dict(headers, **({"Range": f"bytes={done}-"} if done else {}), **{"Accept-Encoding": "identity"})
    # bytes, speed and ETA on a terminal only (stderr in a pipe stays clean); units of 1000, as the log line says sizes
    bar = tqdm(total=size, initial=done, unit="B", unit_scale=True, unit_divisor=1000, desc=name[-40:],
               file=sys.stderr, disable=not sys.stderr.isatty(), leave=False)
    try:
        with get_session().stream("GET", url, headers=asked, timeout=TIMEOUT_S, follow_redirects=True) as r:
            hf_raise_for_status(r)
            if done and r.status_code != 206:  # the server ignored the range: what it sends starts at byte 0
                done = 0
                bar.reset(total=size)
            with open(part, "r+b" if part.is_file() else "wb", buffering=0) as fh:
                fh.truncate(done)
                fh.seek(done)
                for chunk in r.iter_bytes():
                    fh.write(chunk)
                    bar.update(len(chunk))
    except UserError:
        raise
    except hf_errors.HfHubHTTPError as e:
        raise UserError(hub_errors(repo, name).sentence(e)) from None
    except Exception as e:  # noqa: BLE001 - a dropped connection, a timeout: httpx2's classes, not ours to list
        if isinstance(e, OSError) and e.errno is not None:
            raise  # the disk, not the network: fetch's sentence
        have = part.stat().st_size if part.is_file() else 0
        raise UserError(f"the download of {name} from {endpoint()} stopped at {_gb(have)} of {_gb(size)} "
                        f"({first_line(e, 80) or type(e).__name__}); pull again: it continues from there.") from None
    finally:
        bar.close()


def _matches(path: Path, f: HubFile) -> bool:
    """The file against the listing: the LFS sha256, or for a file kept in git its git blob id (sha1 over a
    `blob <size>` header and the bytes)."""
    if f.sha256:
        h = hashlib.sha256()
    elif f.blob_id:
        h = hashlib.sha1(f"blob {path.stat().st_size}\0".encode())
    else:
        return True
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest() == (f.sha256 or f.blob_id)


def _place(storage: Path, blob: Path, dest: Path, commit: str) -> None:
    """The snapshot's entry for the file, a relative link to its blob (a copy where links are refused), and
    `refs/main`, as huggingface_hub writes them."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    if not dest.exists():
        tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
        tmp.unlink(missing_ok=True)
        try:
            os.symlink(os.path.relpath(blob, dest.parent), tmp)
        except OSError:
            shutil.copyfile(blob, tmp)
        os.replace(tmp, dest)
    (storage / "refs").mkdir(exist_ok=True)
    (storage / "refs" / "main").write_text(commit)


# ---------------------------------------------------------------------------------------------------------
# Pulling: the listing, the choice, the disk, the download


def pull_files(name: HubName, log=lambda msg: None, checkpoint: bool = False) -> tuple[Listing, Choice, list[Path]]:
    """Download what `name` names into the cache. Says in one line what, from where and how big first."""
    lst = listing(name.repo)
    choice = choose(lst, name.quant, checkpoint)
    need = missing(lst, choice)
    for f in choice.files:  # every file's HEAD first: a gated repository is refused before the pull is announced
        if not pointer(lst.repo, lst.commit, f.name).exists():
            metadata(lst.repo, lst.commit, f)
    what = (f"{len(choice.files)} files of {name.repo}" if choice.kind == "checkpoint" else
            choice.files[0].name + (f" (+{len(choice.files) - 1} parts)" if len(choice.files) > 1 else ""))
    if need:
        check_disk(need, cache_dir(), f"pulling {name}")
        log(f"pulling {what} from {endpoint()}/{name.repo} ({_gb(choice.size)}"
            + (f", {_gb(choice.size - need)} already here" if need < choice.size else "") + ")")
    started = time.monotonic()
    # each file's metadata asked again right before its download: a CDN's signed URL expires while others download
    paths = [fetch(lst.repo, lst.commit, f) for f in choice.files]
    if need:
        log(f"pulled {_gb(need)} in {time.monotonic() - started:.0f} s into {repo_dir(name.repo)}")
    return lst, choice, paths


def origin(lst: Listing, choice: Choice, paths: list[Path]) -> dict:
    """What a run records of a pulled model: repository, file(s), commit and the files' SHA-256."""
    return {"repo": lst.repo, "commit": lst.commit, "files": [f.name for f in choice.files],
            "sha256": [f.sha256 for f in choice.files], "quant": choice.quant, "endpoint": endpoint()}


def snapshot_origin(path: Path) -> dict | None:
    """The origin of a checkpoint in huggingface_hub's cache, from its path: `models--user--repo/snapshots/<commit>`."""
    parts = Path(path).parts
    if len(parts) >= 3 and parts[-2] == "snapshots" and parts[-3].startswith("models--"):
        return {"repo": parts[-3][len("models--"):].replace("--", "/", 1), "commit": parts[-1]}
    return None


def remove_files(repo: str, names: list[str]) -> int:
    """Delete pulled files from the cache (their blobs and snapshot entries); the bytes freed."""
    freed = 0
    storage = repo_dir(repo)
    for snap in (storage / "snapshots").glob("*"):
        for name in names:
            p = snap / name
            if p.is_symlink() or p.exists():
                blob = p.resolve()
                if blob.is_file() and blob.parent.name == "blobs":
                    freed += blob.stat().st_size
                    blob.unlink()
                elif p.is_file() and not p.is_symlink():
                    freed += p.stat().st_size
                p.unlink(missing_ok=True)
    for part in (storage / "blobs").glob("*.incomplete"):
        freed += part.stat().st_size
        part.unlink()
    return freed


def remove_repo(repo: str) -> int:
    """Delete a repository's folder from the cache; the bytes freed."""
    storage = repo_dir(repo)
    if not storage.is_dir():
        return 0
    freed = sum(p.stat().st_size for p in storage.rglob("*") if p.is_file() and not p.is_symlink())
    shutil.rmtree(storage)
    return freed
