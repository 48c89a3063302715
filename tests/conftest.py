"""Suite-wide environment, set before any test starts a process.

DeepSpeed compiles its CPU comm op with whichever ``ninja`` is first on ``PATH``. Tests that start
the venv's console scripts put the venv's ``bin`` first (its pip ``ninja`` 1.13), the others
inherited the caller's ``PATH`` (a system ``ninja`` 1.11 here): each version rejects the other's
build log, so the op was rebuilt (~40 s) every time the two kinds of test alternated, twice per
run. The venv's ``bin`` goes first for every test, as an activated venv would have it, and in a venv
the op cache is the venv's own (as ``make test`` sets it) when the caller did not choose one.
"""

from __future__ import annotations

import os
import sys

_BIN = os.path.dirname(sys.executable)
_PATH = os.environ.get("PATH", "")
if _PATH.split(os.pathsep)[0] != _BIN:
    os.environ["PATH"] = _BIN + (os.pathsep + _PATH if _PATH else "")
if sys.prefix != sys.base_prefix:  # a venv: its own op cache (not /usr or the base Python's)
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))
