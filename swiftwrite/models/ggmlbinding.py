"""llama-cpp-python, loaded once: its compiled library, what its ggml was built with (llamafile or not), and
llama.cpp's last message, which says why a load or a decode failed. ggmlmodel.py runs models through it."""

from __future__ import annotations

import ctypes
import hashlib
import os
from collections import deque

from ..base.errors import UserError

# the binding without llamafile, whose tiles give 2+ rows other bits (and without llava's library, never loaded)
REBUILD = ('CMAKE_ARGS="-DGGML_LLAMAFILE=OFF -DLLAVA_BUILD=OFF" pip install --force-reinstall --no-cache-dir '
           '--no-deps llama-cpp-python==0.3.36')

_log: deque[tuple[int, str]] = deque(maxlen=16)  # llama.cpp's last messages: the reason behind a failed load, said in one line
_binding = None
_callback = None


def binding():
    """The llama_cpp module, loaded once; UserError with the reason where it is missing or cannot load.

    llama-cpp-python is optional: its wheel builds llama.cpp from source at install time. Imported here, not at
    module top, because it loads a compiled library the torch path never needs."""
    global _binding, _callback
    if _binding is None:
        try:
            import llama_cpp  # heavy optional dependency (a compiled library), loaded only for the ggml backend

            @llama_cpp.llama_log_callback
            def keep(level, text, user_data):  # errors (3) and warnings (2) are kept for messages; none printed
                if level in (2, 3) and text:
                    _log.append((level, text.decode("utf-8", "replace").strip()))

            llama_cpp.llama_log_set(keep, ctypes.c_void_p(0))
            # K-quant products of 8+ rows take a tiled path with other bits than one row's; ggml reads the switch
            # at its first product (a user's own setting stands)
            os.environ.setdefault("GGML_CPU_TILED_MM", "0")
            llama_cpp.llama_backend_init()
        except Exception as e:  # not installed; a library that cannot load here (OSError); a binding of another API
            why = str(e).splitlines()[0] if str(e) else ""
            raise BackendMissing(f"{type(e).__name__}: {why}"[:160]) from None
        _callback = keep  # a ctypes callback must outlive its registration
        _binding = llama_cpp
    return _binding


class BackendMissing(UserError):
    """llama-cpp-python is not installed, or its library does not load here."""


def system_info() -> str:
    """What ggml's CPU backend was built with and found (AVX2 = 1 | AVX512 = 1 | ...)."""
    return binding().llama_print_system_info().decode("utf-8", "replace").strip()


def with_llamafile() -> bool:
    """Whether the binding was built with llamafile (its tiles compute products of 2+ rows with other bits)."""
    return "LLAMAFILE = 1" in system_info()


def build_key() -> str:
    """What a probe's finding depends on of the binding: its version and how its ggml was built."""
    lib = binding()
    return hashlib.sha1(f"{lib.__version__}/{system_info()}".encode()).hexdigest()[:10]


def rebuild_hint() -> str:
    """A clause naming the command that rebuilds the binding without llamafile, where it was built with it."""
    if not with_llamafile():
        return ""
    return f" (this llama-cpp-python was built with llamafile; {REBUILD} rebuilds it without)"


def last_message() -> str:
    """llama.cpp's last error (else its last warning): the reason behind a failed load or decode."""
    for wanted in (3, 2):
        for level, text in reversed(_log):
            if level == wanted and text:
                return text
    return "no reason given"


def forget_messages() -> None:
    """Forget llama.cpp's messages so far, so that last_message() gives the next call's."""
    _log.clear()
