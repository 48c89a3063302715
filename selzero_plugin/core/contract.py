"""The contract: everything the ranks of a group must agree on, and the cross-rank check.

The check costs one all-gather of a 32-byte digest per rank. Only on a mismatch do the ranks
exchange the field lists of group rank 0 and of the first differing rank, so that every rank
raises the same error naming that rank and the first field that differs.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch

from .comm import Communicator
from .. import errors
from ..errors import ContractError, SelZeroError

__all__ = ["Field", "check_contract", "agree_on_local_errors", "first_difference", "digest"]

Field = tuple[str, Any]  # (key, JSON-able value)


def digest(fields: list[Field]) -> bytes:
    return hashlib.sha256(_encode(fields)).digest()


def _encode(fields: list[Field]) -> bytes:
    return json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()


def first_difference(a: list[Field], b: list[Field]) -> tuple[str, Any, Any]:
    """(key, value in a, value in b) of the first field that differs; descends into dicts."""
    for i in range(max(len(a), len(b))):
        if i >= len(a) or i >= len(b):
            key = (b if i >= len(a) else a)[i][0]
            return key, _at(a, i), _at(b, i)
        (ka, va), (kb, vb) = a[i], b[i]
        if ka != kb:
            return f"{ka} / {kb}", va, vb
        if va != vb:
            return _first_leaf(ka, va, vb)
    raise AssertionError("first_difference called on equal field lists")


def _first_leaf(key: str, va: Any, vb: Any) -> tuple[str, Any, Any]:
    """Descend into nested dicts to the first differing value (``...hyperparameters.lr``), and
    name the parameter a ``selected[i]`` field is about, so the error says which tensor differs."""
    if not (isinstance(va, dict) and isinstance(vb, dict)):
        return key, va, vb
    for sub in list(va) + [k for k in vb if k not in va]:
        a, b = va.get(sub, "<absent>"), vb.get(sub, "<absent>")
        if a != b:
            leaf, a, b = _first_leaf(f"{key}.{sub}", a, b)
            if sub != "name" and "name" in va and va["name"] == vb.get("name"):
                leaf += f' (parameter "{va["name"]}")'
            return leaf, a, b
    return key, va, vb


def _at(fields: list[Field], i: int) -> Any:
    return fields[i][1] if i < len(fields) else "<absent>"


def check_contract(comm: Communicator, fields: list[Field], *, what: str) -> None:
    """Raise the same ContractError on every rank unless all ranks hold equal ``fields``."""
    raw = digest(fields)
    mine = torch.tensor([int.from_bytes(raw[i:i + 8], "little", signed=True) for i in range(0, 32, 8)],
                        dtype=torch.int64, device=comm.device)
    gathered = torch.zeros(4 * comm.size, dtype=torch.int64, device=comm.device)
    comm.all_gather(gathered, mine)
    rows = gathered.view(comm.size, 4).cpu()
    differing = [r for r in range(comm.size) if not torch.equal(rows[r], rows[0])]
    if not differing:
        return
    other = differing[0]
    ref = _decode(comm.broadcast_bytes(_encode(fields), src=0))
    theirs = _decode(comm.broadcast_bytes(_encode(fields), src=other))
    key, v0, v1 = first_difference(ref, theirs)
    raise ContractError(
        f"[rank {comm.rank}/{comm.size}] {what}: group rank {other} differs from group rank 0 in "
        f"{key!r}: rank 0 has {json.dumps(v0)}, rank {other} has {json.dumps(v1)} "
        f"({len(differing)} rank(s) differ: {differing[:8]}). Every rank of the group must build "
        "the same model, selection and optimizer settings.")


def _decode(data: bytes) -> list[Field]:
    return [(k, v) for k, v in json.loads(data.decode())]


def agree_on_local_errors(comm: Communicator, error: SelZeroError | None, *, what: str,
                          token: bytes | None = None,
                          token_error: type[SelZeroError] = ContractError,
                          token_what: str = "value") -> None:
    """If any rank failed a local check, raise that rank's error (same class) on every rank.

    With ``token`` (e.g. the sha256 of a file each rank read), the same exchange also checks
    that every rank holds the same token, and raises ``token_error`` on every rank otherwise.
    """
    words = _token_words(token)
    rows = torch.zeros(comm.size * (1 + len(words)), dtype=torch.int64, device=comm.device)
    mine = torch.tensor([int(error is not None), *words], dtype=torch.int64, device=comm.device)
    comm.all_gather(rows, mine)
    table = rows.view(comm.size, -1).tolist()
    failed = [r for r in range(comm.size) if table[r][0]]
    if failed:
        _raise_first(comm, error, failed, what)
    differing = [r for r in range(comm.size) if table[r][1:] != table[0][1:]]
    if differing:
        raise token_error(
            f"[rank {comm.rank}/{comm.size}] {what}: group rank {differing[0]} holds a different "
            f"{token_what} than group rank 0 ({len(differing)} rank(s) differ: "
            f"{differing[:8]}); every rank must use the same one.")


def _token_words(token: bytes | None) -> list[int]:
    if token is None:
        return []
    raw = hashlib.sha256(token).digest()
    return [int.from_bytes(raw[i:i + 8], "little", signed=True) for i in range(0, 32, 8)]


def _raise_first(comm: Communicator, error: SelZeroError | None, failed: list[int],
                 what: str) -> None:
    first = failed[0]
    payload = f"{type(error).__name__}\n{error}".encode() if error is not None else None
    name, _, message = comm.broadcast_bytes(payload, src=first).decode().partition("\n")
    cls = getattr(errors, name, ContractError)
    if not (isinstance(cls, type) and issubclass(cls, SelZeroError)):
        cls = ContractError
    raise cls(f"[rank {comm.rank}/{comm.size}] {what} failed on group rank {first}"
              f"{f' (and {len(failed) - 1} more)' if len(failed) > 1 else ''}: {message}")
