"""The on-disk format ([Note: checkpoint format]): golden file names, manifest keys, shard keys;
the streaming safetensors writer's exact bytes; no pickle anywhere."""

from __future__ import annotations

import hashlib
import inspect
import json
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import selzero_plugin
from selzero_plugin.checkpoint import atomic, load, safetensors_io, save
from selzero_plugin.checkpoint import format as checkpoint
from selzero_plugin.checkpoint import tools as checkpoint_tools
from selzero_plugin.checkpoint import chunk_range, shard_file_name, virtual_key
from selzero_plugin.checkpoint.safetensors_io import StreamingWriter, TensorPlan

from . import _ckpt
from .dist_utils import all_values, run_ranks

_saved: dict[str, Any] = {}


def _folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-rank save of the fused model (tied alias, frozen scale, 4 experts), AdamW, 2 steps."""
    if not _saved:
        folder = tmp_path_factory.mktemp("format") / "ckpt"
        all_values(run_ranks(_ckpt.save_only, 2, str(folder), kind="fused", opt="AdamW", k=2,
                             timeout=240))
        _saved["folder"] = folder
    return _saved["folder"]


def _golden(name: str, shape: list[int], *, aliases: tuple[str, ...] = (), frozen: bool = False,
            experts: int | None = None) -> dict:
    return {"name": name, "local_name": name, "aliases": list(aliases), "shape": shape,
            "dtype": "float32", "frozen": frozen, "experts": experts, "placement": None}


GOLDEN_ENTRIES = [
    _golden("scale", [3], frozen=True),
    _golden("inp.weight", [7, 7], aliases=("tied.weight",)),
    _golden("inp.bias", [7], aliases=("tied.bias",)),
    _golden("experts.gate_up", [4, 7, 5], experts=4),
    _golden("experts.down", [4, 5, 7], experts=4),
    _golden("experts.bias", [4, 7], experts=4),
    _golden("out.weight", [3, 7]),
    _golden("out.bias", [3]),
]
ADAMW_STATE = {"exp_avg": {"kind": "elementwise", "dtype": "float32"},
               "exp_avg_sq": {"kind": "elementwise", "dtype": "float32"},
               "step": {"kind": "scalar", "dtype": "float32"}}


@pytest.mark.multiproc
def test_golden_file_names(tmp_path_factory):
    folder = _folder(tmp_path_factory)
    assert sorted(p.name for p in folder.parent.iterdir()) == ["ckpt"]  # no staging left over
    assert sorted(p.name for p in folder.iterdir()) == [
        "manifest.json", "shard-00000-of-00002.safetensors", "shard-00001-of-00002.safetensors"]
    assert shard_file_name(3, 128) == "shard-00003-of-00128.safetensors"


@pytest.mark.multiproc
def test_golden_manifest(tmp_path_factory):
    folder = _folder(tmp_path_factory)
    m = json.loads((folder / "manifest.json").read_text())
    assert list(m) == ["format", "format_version", "package_version", "name", "group_size",
                       "contract", "virtuals", "optimizer", "expert_parallel", "normalization",
                       "config", "shards"]
    assert m["expert_parallel"] is None
    assert (m["format"], m["format_version"], m["package_version"], m["name"], m["group_size"]) \
        == ("selzero-checkpoint", 1, selzero_plugin.__version__, "selected_zero2", 2)
    assert m["contract"] == {"entries": GOLDEN_ENTRIES, "chunking": checkpoint.CHUNKING}
    virtuals = [(v["key"], v["entry"], v["expert"], v["numel"], v["group"], v["stateful"])
                for v in m["virtuals"]]
    experts = [(f"experts.{n}[expert {e}]", f"experts.{n}", e, numel, 0, e != 3)
               for n, numel in (("gate_up", 35), ("down", 35), ("bias", 7)) for e in range(4)]
    assert virtuals == [("inp.weight", "inp.weight", None, 49, 0, True),
                        ("inp.bias", "inp.bias", None, 7, 0, True), *experts,
                        ("out.weight", "out.weight", None, 21, 0, True),
                        ("out.bias", "out.bias", None, 3, 0, True)]
    assert list(m["virtuals"][0]) == ["key", "entry", "expert", "numel", "group", "stateful"]
    assert m["optimizer"]["class"] == "torch.optim.adamw.AdamW"
    (group,) = m["optimizer"]["param_groups"]
    assert list(group) == ["hyperparameters", "state"] and group["state"] == ADAMW_STATE
    hyper = group["hyperparameters"]
    assert hyper["lr"] == 0.01 and hyper["weight_decay"] == 0.1 and hyper["betas"] == [0.9, 0.999]
    assert m["normalization"] == {"reduction": "mean", "normalize_over": "group",
                                  "missing_grad": "zero", "nonfinite": "error"}
    assert m["config"] == _ckpt.config("fused").to_dict()
    assert [list(s) for s in m["shards"]] == [["rank", "file", "bytes", "sha256"]] * 2
    for r, s in enumerate(m["shards"]):
        path = folder / s["file"]
        assert (s["rank"], s["file"]) == (r, shard_file_name(r, 2))
        assert s["bytes"] == path.stat().st_size
        assert s["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.multiproc
def test_golden_shard_keys_shapes_and_order(tmp_path_factory):
    folder = _folder(tmp_path_factory)
    path = folder / shard_file_name(0, 2)
    (length,) = struct.unpack("<Q", path.read_bytes()[:8])
    header = json.loads(path.read_bytes()[8:8 + length])
    assert header.pop("__metadata__") == {"format": "pt"}
    order = sorted(header, key=lambda k: header[k]["data_offsets"][0])  # file order
    expected: list[tuple[str, str, list[int]]] = []
    for key, numel, stateful in [("inp.weight", 49, True), ("inp.bias", 7, True),
                                 *[(f"experts.{n}[expert {e}]", numel, e != 3)
                                   for n, numel in (("gate_up", 35), ("down", 35), ("bias", 7))
                                   for e in range(4)],
                                 ("out.weight", 21, True), ("out.bias", 3, True)]:
        chunk = [chunk_range(numel, 2, 0)[1]]
        expected.append((f"{key}/value", "F32", chunk))
        if stateful:
            expected += [(f"{key}/exp_avg", "F32", chunk), (f"{key}/exp_avg_sq", "F32", chunk),
                         (f"{key}/step", "F32", [])]
    assert [(k, header[k]["dtype"], header[k]["shape"]) for k in order] == expected
    assert expected[0] == ("inp.weight/value", "F32", [25])  # ceil(49 / 2)
    tensors = load_file(path)  # the reference reader accepts the streamed file
    assert float(tensors["inp.weight/step"]) == 2.0
    assert float(tensors["experts.gate_up[expert 0]/step"]) == 1.0  # absent at step 1


def test_expert_keys_read_like_selzeros_messages():
    assert virtual_key("mlp.experts.gate_up_proj", 3) == "mlp.experts.gate_up_proj[expert 3]"
    assert virtual_key("experts.0.w1.weight", None) == "experts.0.w1.weight"


def test_streaming_writer_writes_the_exact_safetensors_bytes(tmp_path):
    path = tmp_path / "t.safetensors"
    plan = [TensorPlan("a/value", torch.float32, (2,)), TensorPlan("a/step", torch.float32, ())]
    writer = StreamingWriter(path, plan, {"format": "pt"})
    writer.write("a/value", torch.tensor([1.0, -2.0]))
    writer.write("a/step", torch.tensor(3.0))
    size, digest = writer.close()
    header = (b'{"__metadata__":{"format":"pt"},'
              b'"a/value":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},'
              b'"a/step":{"dtype":"F32","shape":[],"data_offsets":[8,12]}}')
    header += b" " * (-len(header) % 8)
    golden = struct.pack("<Q", len(header)) + header + struct.pack("<fff", 1.0, -2.0, 3.0)
    assert path.read_bytes() == golden
    assert (size, digest) == (len(golden), hashlib.sha256(golden).hexdigest())
    with safe_open(str(path), framework="pt") as f:
        assert torch.equal(f.get_tensor("a/value"), torch.tensor([1.0, -2.0]))


def test_cannot_stream_tensors_out_of_plan(tmp_path):
    writer = StreamingWriter(tmp_path / "t.safetensors",
                             [TensorPlan("a", torch.float32, (2,))], None)
    with pytest.raises(ValueError, match="expected tensor 'a' float32 \\[2\\] next"):
        writer.write("a", torch.zeros(3))
    with pytest.raises(ValueError, match="never written"):
        writer.close()


def test_no_pickle_in_the_checkpoint_code_except_the_explicit_torch_export():
    """Shards are safetensors, the manifest JSON; the only torch.save calls are the exports a
    user asks for (--torch-optim-state, and --torch-state-dict to a name not ending in
    .safetensors)."""
    for module in (checkpoint, save, load, checkpoint_tools, atomic, safetensors_io):
        source = inspect.getsource(module)
        assert "import pickle" not in source and "torch.load" not in source
        saves = source.count("torch.save(")
        assert saves == (2 if module is checkpoint_tools else 0), module.__name__
    assert "torch.save(" in inspect.getsource(checkpoint_tools.export_torch_state_dict)
    assert "torch.save(" in inspect.getsource(checkpoint_tools.export_model_state)


def _rewrite_header(path, change):
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + length])
    change(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    data = raw[8 + length:]
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


@pytest.mark.parametrize("case", ["float shape", "string offsets", "bool dimension",
                                  "negative offset", "gap", "unknown dtype", "short file"])
def test_lazy_shard_refuses_a_header_safetensors_refuses(tmp_path, case):
    """Review finding: LazyShard coerced header values with int(), so a shape of 17.0 or
    offsets of "968" passed the load's checks that safetensors' parser refuses, and the load
    then failed part way (after the ranks agreed, leaving a mixture)."""
    LazyShard, SafetensorError = safetensors_io.LazyShard, safetensors_io.SafetensorError
    path = tmp_path / "x.safetensors"
    plan = [TensorPlan("a", torch.float32, (3,)), TensorPlan("b", torch.float32, (2, 2))]
    with StreamingWriter(path, plan) as w:
        w.write("a", torch.arange(3.0))
        w.write("b", torch.ones(2, 2))
        w.close()
    reader = LazyShard(path)
    assert reader.header() == {"a": ("F32", (3,)), "b": ("F32", (2, 2))}
    assert torch.equal(reader.read("b"), torch.ones(2, 2))
    reader.close()
    edits = {
        "float shape": lambda h: h["a"].update(shape=[3.0]),
        "string offsets": lambda h: h["a"].update(data_offsets=["0", "12"]),
        "bool dimension": lambda h: h["a"].update(shape=[True, 3]),
        "negative offset": lambda h: h["a"].update(data_offsets=[-4, 8]),
        "gap": lambda h: h["b"].update(data_offsets=[16, 32]),
        "unknown dtype": lambda h: h["a"].update(dtype="F31"),
        "short file": None,
    }
    if case == "short file":
        path.write_bytes(path.read_bytes()[:-4])
    else:
        _rewrite_header(path, edits[case])
    with pytest.raises(SafetensorError):
        LazyShard(path).header()
    with pytest.raises(SafetensorError):
        LazyShard(path).read("a")
