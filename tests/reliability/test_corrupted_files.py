"""Reliability 4: corrupted checkpoint files. A checkpoint is saved once; hypothesis then damages
a copy (manifest: JSON values replaced, keys deleted, text truncated or flipped; shards: byte
flips anywhere, truncation, the header of another safetensors file spliced in) and loads it into
an engine whose state differs. Loading either succeeds and gives exactly the intact checkpoint's
state, or raises CheckpointError and leaves the state untouched: never another exception, never
a partial change."""

from __future__ import annotations

import json
import shutil
import struct
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save as st_save

from selzero_plugin import CheckpointError, SelectedZero2

from ..models import ToyMoE, loss_fn, make_batch

BUDGET = settings(max_examples=60, deadline=None, database=None,
                  suppress_health_check=[HealthCheck.function_scoped_fixture,
                                         HealthCheck.too_slow])
SHARD = "shard-00000-of-00001.safetensors"
OUTCOMES: dict[str, int] = {"loaded": 0, "refused": 0}


def _engine(seed: int) -> tuple[ToyMoE, SelectedZero2]:
    torch.manual_seed(0)
    model = ToyMoE()
    sz = SelectedZero2(model, {"params": ["experts.*"]}, torch.optim.AdamW,
                       {"lr": 1e-2, "weight_decay": 0.1})
    for step in range(2):
        x, y = make_batch(seed * 10 + step, 0)
        loss_fn(model, x, y, (torch.arange(6) + seed) % 4).backward()
        sz.step()
    return model, sz


def _state(model: ToyMoE, sz: SelectedZero2) -> list[torch.Tensor]:
    out = [e.param.detach().clone() for e in sz.entries]  # what the checkpoint holds
    out += [p.detach().clone() for p in model.parameters()]  # the rest: never touched
    for seg in sz.segments:
        state = sz.optimizer.state.get(seg, {})
        for key in sorted(state):
            v = state[key]
            out.append(v.detach().clone() if isinstance(v, torch.Tensor) else torch.tensor(v))
    return out + [sz.master_flat.clone()]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def saved() -> Any:
    root = Path(tempfile.mkdtemp(prefix="selzero-fuzz-"))
    model, sz = _engine(seed=1)
    sz.save_checkpoint(root / "intact")
    target, tsz = _engine(seed=2)
    # what any successful load must give: the saver's selected parameters and selzero state,
    # the target's own other parameters
    saver, reference = _state(model, sz), _state(target, tsz)
    n, selected = len(sz.entries), {id(e.param) for e in sz.entries}
    for i, p in enumerate(model.parameters()):
        if id(p) in selected:
            reference[n + i] = saver[n + i]
    rest = n + len(list(model.parameters()))
    reference[:n], reference[rest:] = saver[:n], saver[rest:]
    assert not _same(_state(target, tsz), reference)
    tsz.load_checkpoint(root / "intact")
    assert _same(_state(target, tsz), reference)
    yield root, reference
    shutil.rmtree(root, ignore_errors=True)


def _load_damaged(root: Path, reference: list[torch.Tensor], damage: Any) -> None:
    folder = Path(tempfile.mkdtemp(dir=root))
    try:
        shutil.copytree(root / "intact", folder / "ckpt")
        damage(folder / "ckpt")
        model, sz = _engine(seed=2)
        before = _state(model, sz)
        try:
            sz.load_checkpoint(folder / "ckpt")
        except CheckpointError:
            OUTCOMES["refused"] += 1
            assert _same(_state(model, sz), before), "a refused load changed the state"
            return
        OUTCOMES["loaded"] += 1
        assert _same(_state(model, sz), reference), "a load succeeded with a wrong state"
    finally:
        shutil.rmtree(folder, ignore_errors=True)


# ---- manifest --------------------------------------------------------------------------------

_JSON = st.recursive(st.none() | st.booleans() | st.integers(-2 ** 63, 2 ** 63) |
                     st.floats(allow_nan=False) | st.text(max_size=8),
                     lambda inner: st.lists(inner, max_size=3) |
                     st.dictionaries(st.text(max_size=5), inner, max_size=3), max_leaves=6)


def _paths(value: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    if isinstance(value, dict):
        for k, v in value.items():
            out += _paths(v, prefix + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _paths(v, prefix + (i,))
    return out


@given(data=st.data())
@BUDGET
def test_fuzzed_manifest_loads_exactly_or_is_refused(saved: Any, data: Any) -> None:
    root, reference = saved
    raw = (root / "intact" / "manifest.json").read_text()
    manifest = json.loads(raw)
    kind = data.draw(st.sampled_from(["replace", "delete", "truncate", "flip"]))

    def damage(folder: Path) -> None:
        path = folder / "manifest.json"
        if kind in ("replace", "delete"):
            where = data.draw(st.sampled_from(_paths(manifest)[1:]))
            tree = json.loads(raw)
            parent = tree
            for key in where[:-1]:
                parent = parent[key]
            if kind == "delete":
                del parent[where[-1]]
            else:
                parent[where[-1]] = data.draw(_JSON)
            path.write_text(json.dumps(tree))
        elif kind == "truncate":
            path.write_text(raw[:data.draw(st.integers(0, len(raw) - 1))])
        else:
            b = bytearray(raw.encode())
            i = data.draw(st.integers(0, len(b) - 1))
            b[i] ^= data.draw(st.integers(1, 255))
            path.write_bytes(bytes(b))

    _load_damaged(root, reference, damage)


# ---- shard -----------------------------------------------------------------------------------

def _foreign_header() -> bytes:
    blob = st_save({"experts.0.w1.weight": torch.zeros(3, 5), "x": torch.ones(7)})
    (n,) = struct.unpack("<Q", blob[:8])
    return blob[:8 + n]


@given(data=st.data())
@BUDGET
def test_fuzzed_shard_loads_exactly_or_is_refused(saved: Any, data: Any) -> None:
    root, reference = saved
    blob = (root / "intact" / SHARD).read_bytes()
    (header_len,) = struct.unpack("<Q", blob[:8])
    kind = data.draw(st.sampled_from(["flip", "flip_header", "truncate", "foreign_header"]))

    def damage(folder: Path) -> None:
        b = bytearray(blob)
        if kind in ("flip", "flip_header"):
            high = 8 + header_len - 1 if kind == "flip_header" else len(b) - 1
            i = data.draw(st.integers(0, high))
            b[i] ^= data.draw(st.integers(1, 255))
        elif kind == "truncate":
            b = b[:data.draw(st.integers(0, len(b) - 1))]
        else:
            b = bytearray(_foreign_header()) + b[8 + header_len:]
        (folder / SHARD).write_bytes(bytes(b))

    _load_damaged(root, reference, damage)


def test_the_fuzzing_exercised_both_outcomes() -> None:
    """Runs after the fuzzers (file order): some damage was refused (and the intact-equivalent
    mutations, e.g. a value replaced by itself, loaded)."""
    print(f"corrupted-file outcomes: {OUTCOMES}")
    assert OUTCOMES["refused"] > 0
