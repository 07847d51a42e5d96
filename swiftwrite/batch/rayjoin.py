"""Joining a Ray cluster for `batch --ray ADDRESS` (raypool.py writes on it): the address asked once, the cluster's
token found where Ray keeps it, and every refusal one sentence, before the batch writes anything.

Why we ask the head ourselves before `ray.init`: Ray 2.60 turns token authentication on for a cluster whose head
found a token when it started (in ~/.ray/auth_token, which every `ray.init()` that starts a cluster writes, `--ray
local` among them; or in RAY_AUTH_TOKEN / RAY_AUTH_TOKEN_PATH). A process that joins sends its token only in token
mode (RAY_AUTH_MODE=token): `ray.init(address="auto")` switches that on where RAY_AUTH_MODE is unset and Ray finds a
token here, an explicit HOST:PORT never does, and then ray.init retries for 20 s and says only that it could not
connect. So we ask the head's GCS first, as ray.init's first step does (Ray's own client, well under a second): where
it refuses us for want of a token and RAY_AUTH_MODE is unset, token mode goes on as `auto` turns it on and we ask
again; a cluster without authentication never receives the token. What the head answers (no token, a refused
token, no Ray head there, another version of Ray) becomes one sentence naming what to change. We never read the
token: a sentence names only where Ray reads it from.

Ray's own log lines (its C++ core writes them to file descriptor 2, outside Python's logging) stay off the terminal
while we join and leave, unless --verbose.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import platform
import socket
import sys
import threading
from pathlib import Path

from ..base.durable import os_reason
from ..base.errors import UsageError, UserError, first_line

LOCAL = "local"  # --ray local: a cluster started in this process, on this machine's cores
AUTO = "auto"  # --ray auto: the cluster `ray start` began on this machine
CONNECT_WAIT = 3.0  # seconds for the head's port to connect, then to answer: ray.init waits minutes for a silent one
ASK_WAIT = 5.0  # seconds for the head's GCS to answer its first question (its cluster id), as ray.init asks it
# Where Ray reads a cluster's token, in its order (its AuthenticationTokenLoader): the first one set is the one sent
TOKEN, TOKEN_PATH, TOKEN_FILE = "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "~/.ray/auth_token"
MODE = "RAY_AUTH_MODE"
# The client's first bytes in HTTP/2 (RFC 9113 3.4), then an empty SETTINGS frame; a gRPC server (the head's GCS)
# answers with a SETTINGS frame of its own: a frame header whose fourth byte, its type, is 4
HTTP2_HELLO = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
SETTINGS = 4
VERSIONS, VERSIONS_KV = b"CLUSTER_METADATA", b"cluster"  # the head's Ray and Python, where Ray's usage_lib keeps them


def missing_ray() -> str:
    return ("--ray needs Ray, which is not installed here; install it with `pip install -e '.[ray]'` (or "
            "`pip install \"ray>=2.9\"`) and run the batch again.")


def import_ray():
    """The ray module, or a UserError saying how to install it."""
    try:
        # Ray is an optional extra (pip install -e '.[ray]'), imported only when --ray is given
        import ray
        import ray.util.scheduling_strategies
    except ImportError:
        raise UserError(missing_ray()) from None
    return ray


@contextlib.contextmanager
def connected(address: str | None, cores: int, verbose: bool = False):
    """Ray joined to the cluster at `address` (or one started here for `local`, on `cores` CPUs) for the duration;
    None where `address` is None. Refused in one sentence, before the batch writes anything."""
    if address is None:
        yield None
        return
    ray = import_ray()
    # the actors' own output stays in Ray's logs unless --verbose: what a document says comes back with its result
    said = {"log_to_driver": True, "logging_level": logging.INFO} if verbose else \
        {"log_to_driver": False, "logging_level": logging.ERROR}
    with ray_quiet(verbose):
        if address == LOCAL:
            ray.init(num_cpus=cores, include_dashboard=False, **said)
        else:
            _join(ray, address, said)
    try:
        yield ray
    finally:
        with ray_quiet(verbose):
            ray.shutdown()


@contextlib.contextmanager
def ray_quiet(verbose: bool):
    """File descriptor 2 to /dev/null for the duration (unless `verbose`): Ray's C++ core logs there before its
    logging is set up (every failed try to reach a head, say), where Python's logging levels do not reach."""
    if verbose:
        yield
        return
    sys.stderr.flush()
    kept, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    os.close(null)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(kept, 2)
        os.close(kept)


def check(address: str | None, verbose: bool = False) -> None:
    """Refuse, in one sentence, a cluster `connected` would not join, before the command loads its heavy modules
    (seconds of torch) or writes anything; `connected` asks again (a few milliseconds)."""
    if address in (None, LOCAL):
        return
    ray = import_ray()
    with ray_quiet(verbose):
        _asked(ray, address)


def _join(ray, address: str, said: dict) -> None:
    """ray.init on the cluster at `address`, its head asked first (the module's docstring says why)."""
    target = _asked(ray, address)
    try:
        ray.init(address=target, **said)
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise UserError(f"could not join the Ray cluster at {address} ({first_line(e)}); run `ray status` on its "
                        "head to see that it is up, or use --ray local.") from None


def _asked(ray, address: str) -> str:
    """The cluster's head at `address` (HOST:PORT, auto, or ray://HOST:PORT for Ray Client) as HOST:PORT, once it
    has answered as a head of this Ray's version that takes us (token mode on where it asks for a token)."""
    target = _resolve(ray, address)
    source = _token_source()
    _answers(target, address)
    if not address.startswith("ray://"):  # Ray Client's port is no GCS: ray.init alone speaks to it
        client = _ask_head(ray, target, address, source)
        if client is not None:
            _same_versions(ray, client, address)
    return target


def _resolve(ray, address: str) -> str:
    """`address` as HOST:PORT (ray:// kept): `auto` as Ray finds the cluster `ray start` began on this machine."""
    if address == AUTO:
        try:
            return ray._private.services.canonicalize_bootstrap_address_or_die(AUTO)
        except ConnectionError:
            raise UserError("--ray auto joins the cluster `ray start --head` began on this machine, and none runs "
                            "here; start one, give its head as HOST:PORT, or use --ray local.") from None
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        raise UsageError(f"--ray {address}: give the cluster's head as HOST:PORT, `auto` for the cluster `ray start` "
                         "began on this machine, or `local` to start one here.")
    return address


def _answers(target: str, address: str) -> None:
    """Refuse at once an address where nothing answers (ray.init waits minutes for it), or where what answers
    speaks no HTTP/2, as every Ray head's GCS does (a web server, a port of something else)."""
    host, _, port = target.removeprefix("ray://").rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_WAIT) as s:
            s.sendall(HTTP2_HELLO)
            header = s.recv(9)
    except socket.timeout:
        header = b""  # it took the connection and said nothing
    except OSError as e:
        raise UserError(f"nothing answers at the Ray address {address} ({os_reason(e) or 'no answer'}); start the "
                        "cluster's head there (`ray start --head`), give its address, or use --ray local.") from None
    if len(header) < 4 or header[3] != SETTINGS:
        raise UserError(_not_a_head(address))


def _not_a_head(address: str) -> str:
    return (f"something answers at {address}, but not a Ray cluster's head; give the address `ray start --head` "
            "printed (port 6379 unless it was given --port), or use --ray local.")


def _token_source() -> str | None:
    """Where Ray will read the cluster's token from, in its words (never the token), or None where it finds none.
    RAY_AUTH_TOKEN_PATH naming no readable file is refused here: Ray's core aborts the process on it."""
    if os.environ.get(TOKEN):
        return TOKEN
    path = os.environ.get(TOKEN_PATH)
    if path:
        p = Path(path).expanduser()
        if not (p.is_file() and os.access(p, os.R_OK) and p.stat().st_size > 0):
            raise UserError(f"{TOKEN_PATH} names {path}, which cannot be read or is empty; point it at the file that "
                            "holds the Ray cluster's token, or unset it.")
        return f"the file {TOKEN_PATH} names ({path})"
    return TOKEN_FILE if Path(TOKEN_FILE).expanduser().is_file() else None


def _ask_head(ray, target: str, address: str, source: str | None):
    """Ray's GCS client at `target`, once the head has taken us (token mode switched on where it asks for a token
    and RAY_AUTH_MODE is unset, as ray.init does for `auto`); a refusal in one sentence. None where this Ray has
    no such client (older than token authentication: ray.init alone says what is wrong)."""
    got = _gcs(ray, target)
    refused = getattr(ray.exceptions, "AuthenticationError", ())  # a Ray without token authentication has none
    if isinstance(got, refused) and os.environ.get(MODE) is None and source is not None:
        # ray.init's own step for `auto`: token mode for this process, as RAY_AUTH_MODE=token would set it
        ray._private.authentication.authentication_token_setup.maybe_enable_token_auth_if_token_available(
            warn_if_disabled=False)
        got = _gcs(ray, target)
    if isinstance(got, refused):
        raise UserError(_refusal(address, os.environ.get(MODE), source))
    if isinstance(got, Exception) or got is False:
        raise UserError(_not_a_head(address))
    return got


def _gcs(ray, target: str):
    """Ray's GCS client at `target`, the exception it raised, False where the head said nothing in ASK_WAIT s, or
    None where this Ray has no standalone client. The call blocks in Ray's C++ with the GIL released: a thread
    bounds it (its own timeout is ASK_WAIT on top of two 5-second waits for a connection)."""
    client = getattr(ray._raylet, "InnerGcsClient", None)  # a Ray without it: ray.init alone says what is wrong
    if client is None:
        return None
    got = []

    def ask():
        try:
            got.append(client.standalone(target, None, int(ASK_WAIT * 1000)))
        except Exception as e:  # Ray's errors: AuthenticationError, RpcError, ...
            got.append(e)

    asking = threading.Thread(target=ask, daemon=True)
    asking.start()
    asking.join(ASK_WAIT)
    return got[0] if got else False


def _refusal(address: str, mode: str | None, source: str | None) -> str:
    """The sentence for a head that refused us for its token."""
    where = f"~/.ray/auth_token, a file named by {TOKEN_PATH}, or {TOKEN}"
    if mode is not None and mode.lower() != "token":
        return (f"the Ray cluster at {address} asks for its authentication token, and {MODE}={mode} here sends none; "
                f"unset {MODE} (or set it to token) with the head's token in {where}.")
    if source is None:
        return (f"the Ray cluster at {address} asks for its authentication token, and Ray finds none here; put the "
                f"head's token (`ray get-auth-token` prints it there) in {where}, and run the batch again.")
    return (f"the Ray cluster at {address} refused the authentication token in {source}; put the head's own there "
            "(`ray get-auth-token` prints it on the head), and run the batch again.")


def _same_versions(ray, client, address: str) -> None:
    """Refuse a cluster whose Ray or Python is not this process's, as ray.init would (its rule: the same Ray, the
    same Python to the patch unless RAY_DEFAULT_PYTHON_VERSION_MATCH_LEVEL says minor), in one sentence."""
    try:
        cluster = json.loads(client.internal_kv_get(VERSIONS, namespace=VERSIONS_KV))
        ray._private.utils.check_version_info(cluster, "this machine")
    except RuntimeError as e:
        if "ersion mismatch" not in str(e):
            return  # no metadata to compare (a head still starting): ray.init asks again
        raise UserError(f"the Ray cluster at {address} runs Ray {cluster['ray_version']} on Python "
                        f"{cluster['python_version']}, this machine Ray {ray.__version__} on Python "
                        f"{platform.python_version()}; run the batch where both match the cluster's (`pip install "
                        f"\"ray=={cluster['ray_version']}\"`), or use --ray local.") from None
    except (AttributeError, KeyError, TypeError, ValueError):
        return  # none, or not as this Ray writes it: ray.init's own check stands
