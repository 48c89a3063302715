"""Offline checkpoint tools: inspect / verify, reshard (N -> M ranks), consolidate, torch export.

[Note: streaming tools]
Reshard and consolidate never hold more than one tensor of one parameter in full (plus the
chunk being copied and constant overhead): ``iter_full_state`` assembles a virtual parameter's
value, then each of its state tensors, one at a time from the input shards, and the writers
(``StreamingWriter``, whose headers are planned from the manifest before any data) append each
slice as it comes. Input files are read through ``LazyShard``, one positional read per tensor
(no mapping whose touched pages would accumulate). Only the ``--torch-state-dict`` export holds the whole subset's state: a pickled
``torch.optim`` state dict has no other form.

The consolidated file is one safetensors file keyed like the shards (``{key}/value``,
``{key}/exp_avg``, ...) with full virtual-parameter shapes (an expert of a fused ``(E, a, b)``
tensor is ``(a, b)``), and the manifest minus group size and shard list in its metadata
(``selzero``). It does not depend on the group size, so consolidating before and after a
reshard gives byte-identical files.

The torch export is ``{"state": {i: {...}}, "param_groups": [{..., "params": [i, ...]}]}`` where
``i`` is the parameter's index in ``selected_names`` (the manifest's ``contract.entries`` order,
frozen parameters included, so a frozen one's index is simply absent). Each group lists its
members in that order; groups without members are left out. Build the optimizer with the same
groups over the same parameters to ``load_state_dict`` it. Fused experts are merged back into
the whole ``(E, ...)`` tensor: elementwise state is stacked (zeros for an expert that was never
stepped), and a scalar state such as ``step``, one per expert in selzero, becomes the value of
the expert with the most steps; when the experts disagree the export warns, since torch keeps
one step count per tensor and cannot express the difference.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch
from safetensors import safe_open

from .atomic import (MANIFEST_NAME, is_staging, make_staging, previous_folder, put_in_place,
                     refuse_to_replace)
from ..errors import CheckpointError
from .safetensors_io import dtype_from_name
from .format import (SCALAR, VALUE, Manifest, VirtualRecord, check_shard, chunk_range,
                     consolidated_plan, piece_range, read_manifest, replan, shard_file_name,
                     shard_plan, spec_of, state_specs, tensor_key, tensor_shape, whats,
                     write_manifest)
from .safetensors_io import LazyShard, StreamingWriter

__all__ = ["open_checkpoint", "verify", "FullStateReader", "iter_full_state", "write_sharded", "reshard",
           "consolidate", "export_torch_state_dict", "inspect", "InspectReport", "run_inspect",
           "run_reshard", "run_consolidate"]




def _progress(iterable: Iterable[Any], *, total: int, desc: str, unit: str) -> Iterable[Any]:
    """A tqdm bar on a terminal; the bare iterable otherwise (logs stay clean)."""
    if not sys.stderr.isatty():
        return iterable
    from tqdm import tqdm

    return tqdm(iterable, total=total, desc=desc, unit=unit, file=sys.stderr)


def open_checkpoint(folder: str | os.PathLike[str]) -> tuple[Path, Manifest]:
    """Exactly ``folder`` (offline tools do not fall back to ``<folder>.previous``)."""
    path = Path(folder)
    if is_staging(path):
        raise CheckpointError(f"{path} is the staging folder of an unfinished save (it was never "
                              "put in place); it is not a checkpoint. Delete it.")
    if not path.is_dir():
        hint = ""
        if (previous_folder(path) / MANIFEST_NAME).is_file():
            hint = (f" {previous_folder(path)} holds the last complete checkpoint (a save was "
                    "interrupted while replacing it).")
        raise CheckpointError(f"no checkpoint at {path}: the folder does not exist.{hint}")
    return path, read_manifest(path)


def verify(folder: Path, manifest: Manifest) -> list[str]:
    """Problems found in the shards (missing, size, sha256, tensors); empty when all is well."""
    def check(rank: int) -> str | None:
        try:
            check_shard(folder, manifest, rank)
        except CheckpointError as e:
            return str(e)
        return None

    n = manifest.group_size  # shards hashed side by side (hashlib releases the GIL)
    with ThreadPoolExecutor(max_workers=max(1, min(n, os.cpu_count() or 1, 8))) as pool:
        problems = [p for p in _progress(pool.map(check, range(n)), total=n, desc="verify",
                                         unit="shard") if p is not None]
    expected = {shard_file_name(r, manifest.group_size) for r in range(manifest.group_size)}
    stray = sorted(p.name for p in folder.glob("shard-*.safetensors") if p.name not in expected)
    if stray:
        problems.append(f"{folder}: shard files of another group size are mixed in: {stray[:4]}")
    return problems


def _require_valid(folder: Path, manifest: Manifest) -> None:
    problems = verify(folder, manifest)
    if problems:
        raise CheckpointError(f"{folder} failed verification; nothing was written: "
                              + " | ".join(problems))


# ---- streaming full state -------------------------------------------------------------------


class FullStateReader:
    """A virtual parameter's full tensors, assembled from a checkpoint's shards one at a time."""

    def __init__(self, folder: Path, manifest: Manifest) -> None:
        self.manifest = manifest
        n = manifest.group_size
        self.readers = [LazyShard(folder / shard_file_name(r, n)) for r in range(n)]

    def full(self, v: VirtualRecord) -> Iterator[tuple[str, torch.Tensor]]:
        """(what, full tensor) for each tensor of ``v``, in file order, in its consolidated
        shape (``tensor_shape``: the virtual shape, a 0-dim scalar, or a state's own)."""
        manifest, readers, n = self.manifest, self.readers, self.manifest.group_size
        if v.owner is not None:  # whole-tensor ownership: whole in its owner's shard
            for what in whats(manifest, v):
                part = readers[v.owner].read(tensor_key(v.key, what))
                yield what, part.reshape(tensor_shape(v, spec_of(manifest, v, what)))
                del part
            return
        owners = [r for r in range(n) if chunk_range(v.numel, n, r)[1] > 0]
        for what in whats(manifest, v):
            key = tensor_key(v.key, what)
            if what != VALUE and manifest.group_state[v.group][what].kind == SCALAR:
                yield what, _agreed_scalar(readers, owners, key)
                continue
            full = None
            for r in owners:
                start, length = chunk_range(v.numel, n, r)
                part = readers[r].read(key)
                if full is None:
                    full = torch.empty(v.numel, dtype=part.dtype)
                full[start:start + length].copy_(part)
                del part
            assert full is not None
            yield what, full.view(v.shape)
            del full

    def close(self) -> None:
        for reader in self.readers:
            reader.close()


def iter_full_state(folder: Path, manifest: Manifest
                    ) -> Iterator[tuple[VirtualRecord, str, torch.Tensor]]:
    """(virtual parameter, what, full tensor in its consolidated shape) in file order, one at a
    time."""
    reader = FullStateReader(folder, manifest)
    try:
        for v in _progress(manifest.virtuals, total=len(manifest.virtuals), desc="parameters",
                           unit="param"):
            for what, full in reader.full(v):
                yield v, what, full
                del full
    finally:
        reader.close()


def full_values(folder: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Every trainable selected tensor's FP32 value, whole, in the model's shape (the experts of
    a fused tensor stacked on dim 0), under its canonical name and its aliases. Frozen selected
    tensors are not in a checkpoint (their values are the module's)."""
    path, manifest = open_checkpoint(folder)
    by_entry: dict[str, dict[int | None, torch.Tensor]] = {}
    reader = FullStateReader(path, manifest)
    try:
        for v in manifest.virtuals:
            for what, full in reader.full(v):
                if what == VALUE:
                    by_entry.setdefault(v.entry, {})[v.expert] = full.float().clone()
                del full
    finally:
        reader.close()
    out: dict[str, torch.Tensor] = {}
    for entry in manifest.entries:
        parts = by_entry.get(entry["name"])
        if not parts:
            continue
        if None in parts:
            value = parts[None].reshape(entry["shape"])
        else:
            value = torch.stack([parts[i] for i in sorted(parts)]).reshape(entry["shape"])
        for name in [entry["name"], *entry.get("aliases", [])]:
            out[name] = value
    return out


def _agreed_scalar(readers: list[LazyShard], owners: list[int], key: str) -> torch.Tensor:
    first = readers[owners[0]].read(key)
    for r in owners[1:]:
        if not torch.equal(readers[r].read(key), first):
            raise CheckpointError(f"{key}: the shards of group ranks {owners[0]} and {r} hold "
                                  "different values of this scalar state; the checkpoint mixes "
                                  "saves.")
    return first


def write_sharded(out: Path, manifest: Manifest,
                  stream: Iterable[tuple[VirtualRecord, str, torch.Tensor]]) -> Manifest:
    """Write ``manifest``'s shards (its group size) from full tensors in file order, then the
    manifest, and put the folder in place atomically. Returns the manifest written."""
    reason = refuse_to_replace(out)
    if reason is not None:
        raise CheckpointError(reason)
    n = manifest.group_size
    staging = make_staging(out)
    writers: list[StreamingWriter] = []
    try:
        for r in range(n):
            writers.append(StreamingWriter(staging / shard_file_name(r, n),
                                           [p for p, _, _ in shard_plan(manifest, r)],
                                           {"format": "pt"}))
        targets = manifest.virtual_by_key
        for v, what, full in stream:
            target = targets.get(v.key, v)
            for r in range(n):
                start, length = piece_range(manifest, target, r)
                if not length:
                    continue
                if target.owner is not None or full.dim() == 0:  # whole, in its own shape
                    piece = full
                else:
                    piece = full.reshape(-1)[start:start + length]
                writers[r].write(tensor_key(v.key, what), piece)
            del full  # before the next one is assembled
        records = []
        for r, writer in enumerate(writers):
            size, digest = writer.close()
            records.append({"rank": r, "file": shard_file_name(r, n), "bytes": size,
                            "sha256": digest})
        written = manifest.with_group_size(n, records)
        write_manifest(staging, written.raw)
        put_in_place(staging, out)
        return written
    except BaseException:
        for writer in writers:
            writer.abort()
        shutil.rmtree(staging, ignore_errors=True)
        raise


def reshard(folder: str | os.PathLike[str], world_size: int, out: str | os.PathLike[str]) -> Path:
    """Rewrite a checkpoint for a group of ``world_size`` ranks into ``out`` (streaming)."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise CheckpointError(f"--world-size {world_size!r}: expected a positive integer.")
    path, manifest = open_checkpoint(folder)
    _require_valid(path, manifest)
    target = manifest.with_group_size(world_size, [])
    if "save_id" in target.raw:  # no longer part of the save of several instances it was
        target = Manifest.from_json({k: v for k, v in target.raw.items() if k != "save_id"},
                                    where="resharded manifest")
    write_sharded(Path(out), target, iter_full_state(path, manifest))
    return Path(out)


# ---- consolidate and export -----------------------------------------------------------------


def consolidated_metadata(manifest: Manifest) -> dict[str, str]:
    """The manifest without what depends on the group size or on the save (its size, shards,
    owners, ``save_id``)."""
    raw = {k: v for k, v in manifest.raw.items() if k not in ("group_size", "shards", "save_id")}
    raw["virtuals"] = [{k: v for k, v in record.items() if k != "owner"}
                       for record in raw["virtuals"]]
    return {"format": "pt", "selzero": json.dumps(raw, sort_keys=True, separators=(",", ":"))}


def consolidate(folder: str | os.PathLike[str], out: str | os.PathLike[str], *,
                torch_state_dict: str | os.PathLike[str] | None = None,
                torch_optim_state: str | os.PathLike[str] | None = None) -> Path:
    """Full per-parameter FP32 values and optimizer state in one safetensors file (streaming).
    ``folder``: an instance folder, or a selzero folder / host checkpoint holding one instance."""
    path, manifest = open_checkpoint(_one_instance(Path(folder)))
    _require_valid(path, manifest)
    if torch_state_dict is not None:
        _check_model_export(manifest, path)  # before anything is written
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(f".{out.name}.partial")
    try:
        with StreamingWriter(partial, [p for p, _, _ in consolidated_plan(manifest)],
                             consolidated_metadata(manifest)) as writer:
            for v, what, full in iter_full_state(path, manifest):
                writer.write(tensor_key(v.key, what), full)
                del full  # before the next one is assembled
            writer.close()
        os.replace(partial, out)
    finally:
        partial.unlink(missing_ok=True)
    if torch_state_dict is not None:
        export_model_state(out, torch_state_dict)
    if torch_optim_state is not None:
        export_torch_state_dict(out, torch_optim_state)
    return out


def export_model_state(consolidated: str | os.PathLike[str],
                       out: str | os.PathLike[str]) -> Path:
    """The selected parameters in the model's own names, shapes and dtypes (fused experts
    stacked back into their ``(E, ...)`` tensor, tied names each present), for
    ``model.load_state_dict(sd, strict=False)``: a ``.safetensors`` file, or with any other
    suffix a ``torch.save`` dict (pickle, only when asked). Values are the FP32 masters cast
    to the parameter's dtype. Under expert parallelism the names are the global ones (the
    one-process model's)."""
    manifest = read_consolidated_manifest(consolidated)
    _check_model_export(manifest, Path(consolidated))
    tensors: dict[str, torch.Tensor] = {}
    with safe_open(str(consolidated), framework="pt") as f:
        for entry in manifest.entries:
            virtuals = [v for v in manifest.virtuals if v.entry == entry["name"]]
            if not virtuals:
                continue  # frozen: the model keeps it, selzero never changed it
            parts = [f.get_tensor(tensor_key(v.key, "value")) for v in virtuals]
            full = parts[0] if len(parts) == 1 else torch.stack(
                [p.reshape(v.shape) for p, v in zip(parts, virtuals)])
            value = full.reshape(entry["shape"]).to(dtype_from_name(entry["dtype"]))
            for name in [entry["name"], *entry.get("aliases", [])]:
                tensors[name] = value.clone() if name != entry["name"] else value
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.suffix == ".safetensors":
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in tensors.items()}, str(out),
                  metadata={"format": "pt"})
    else:
        torch.save(tensors, out)
    return out


def _check_model_export(manifest: Manifest, where: Path) -> None:
    ep = manifest.expert_parallel
    if ep is not None and ep[1] > 1:
        raise CheckpointError(
            f"{where}: one of {ep[1]} expert-parallel instances, holding some of the experts "
            "only, so its tensors are not the model's (a fused tensor has fewer rows). Reshard "
            "the selzero folder to one expert-parallel rank first (`selzero reshard "
            "CKPT/selected_zero2 --world-size 1 --ep-size 1 --out ONE`), then consolidate ONE "
            "with --torch-state-dict.")


def _one_instance(folder: Path) -> Path:
    """The instance folder of a selzero folder (index.json) or of the checkpoint holding it,
    when it holds one instance; ``folder`` itself when it holds no index."""
    from .host import read_index
    from .relayout import find_root

    found = find_root(folder)
    if found is None:
        return folder
    root = found[0]
    index = read_index(root, root=True)
    names = [d["name"] for d in index["instances"]]
    if len(names) == 1:
        return root / names[0]
    eps = sorted({d["ep_size"] for d in index["instances"] if d.get("ep_size")})
    hint = (f" Under expert parallelism (size {eps[0]}) each instance holds some experts: "
            f"`selzero reshard {root} --world-size 1 --ep-size 1 --out ONE` gives one instance "
            "holding every expert, whose tensors are the model's.") if eps else ""
    raise CheckpointError(
        f"{root} holds {len(names)} selzero instances ({names[:8]}); a consolidated file is "
        f"one instance's. Consolidate each: `selzero consolidate {root / names[0]} --out "
        f"{names[0]}.safetensors`, and so on.{hint}")


def read_consolidated_manifest(path: str | os.PathLike[str]) -> Manifest:
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    if "selzero" not in meta:
        raise CheckpointError(f"{path}: not a consolidated selzero file (no 'selzero' metadata).")
    raw = json.loads(meta["selzero"])
    raw.update({"group_size": 1, "shards": []})
    return Manifest.from_json(replan(raw), where=str(path))


def export_torch_state_dict(consolidated: str | os.PathLike[str],
                            out: str | os.PathLike[str]) -> Path:
    """The ``torch.optim`` state dict of [Note: streaming tools]: the only pickle selzero
    writes, and only when asked."""
    manifest = read_consolidated_manifest(consolidated)
    classes = sorted(set(manifest.group_classes))
    if len(classes) > 1:
        raise CheckpointError(
            f"{consolidated}: its param groups run several optimizer classes ({classes}); a "
            "torch.optim state dict is one optimizer's. Read the consolidated safetensors file "
            "instead (keys `{name}/{state}`, its metadata names each group's class).")
    if manifest.partition == "tensors":
        _check_torch_can_hold(manifest)
    members: list[list[int]] = [[] for _ in manifest.group_hyper]
    state: dict[int, dict[str, torch.Tensor]] = {}
    uneven: list[str] = []
    with safe_open(str(consolidated), framework="pt") as f:
        for index, entry in enumerate(manifest.entries):
            virtuals = [v for v in manifest.virtuals if v.entry == entry["name"]]
            if not virtuals:
                continue  # frozen: no state
            members[virtuals[0].group].append(index)
            merged = _merged_state(f, manifest, virtuals, entry, uneven)
            if merged:
                state[index] = merged
    if uneven:
        warnings.warn(f"torch export: the experts of {uneven[:5]} were stepped a different number "
                      "of times; torch keeps one step count per tensor, so each takes the count of "
                      "its most-stepped expert (bias correction of the others changes).",
                      stacklevel=2)
    groups = [{**hyper, "params": ids} for hyper, ids in zip(manifest.group_hyper, members) if ids]
    out = Path(out)
    torch.save({"state": state, "param_groups": groups}, out)
    return out


def _check_torch_can_hold(manifest: Manifest) -> None:
    """Whole-tensor ownership keeps each expert of a fused tensor's state in the expert's own
    terms (Adafactor: a 1-D expert's ``variance``); the export stacks it, which torch can step
    only if its optimizer keeps that very state for the whole tensor (review finding)."""
    from ..core.optim import probe_state_shapes, resolve_optimizer_class

    for entry in manifest.entries:
        virtuals = [v for v in manifest.virtuals if v.entry == entry["name"] and v.stateful]
        if entry["frozen"] or not entry["experts"] or not virtuals:
            continue
        name = manifest.group_classes[virtuals[0].group]
        stacked = {k: (len([v for v in manifest.virtuals if v.entry == entry["name"]]),
                       *tensor_shape(virtuals[0], spec)) if spec.kind != SCALAR else ()
                   for k, spec in state_specs(manifest, virtuals[0]).items()}
        try:
            cls = resolve_optimizer_class(name)
            whole = probe_state_shapes(cls, {}, {}, torch.device("cpu"), tuple(entry["shape"]))
            torch_keeps = {k: shape for k, (_, _, shape) in whole.items()}
        except Exception as e:  # noqa: BLE001 - torch's optimizer refuses the whole tensor
            torch_keeps = {"(refused)": str(e)}
        if torch_keeps != stacked:
            raise CheckpointError(
                f"{entry['name']} {tuple(entry['shape'])}: selzero keeps each expert's "
                f"{name} state ({sorted(stacked)}) where torch's {name} over the whole fused "
                f"tensor keeps {torch_keeps}; no torch state dict expresses the per-expert "
                "state. Read the consolidated safetensors file instead (keys "
                "`{name}[expert e]/{state}`).")


def _merged_state(f: Any, manifest: Manifest, virtuals: list[VirtualRecord],
                  entry: dict[str, Any], uneven: list[str]) -> dict[str, torch.Tensor]:
    stepped = [v for v in virtuals if v.stateful]
    if not stepped:
        return {}
    specs = state_specs(manifest, stepped[0])
    if len(virtuals) == 1:
        return {k: f.get_tensor(tensor_key(virtuals[0].key, k)) for k in sorted(specs)}
    scalars = {k: [f.get_tensor(tensor_key(v.key, k)) for v in stepped]
               for k, s in specs.items() if s.kind == SCALAR}
    lead = 0
    if "step" in scalars:
        steps = scalars["step"]
        lead = max(range(len(stepped)), key=lambda i: float(steps[i]))
        if len(stepped) < len(virtuals) or any(not torch.equal(s, steps[0]) for s in steps):
            uneven.append(entry["name"])
    merged = {}
    for key, spec in sorted(specs.items()):
        if spec.kind == SCALAR:
            merged[key] = scalars[key][lead]
        else:
            merged[key] = torch.stack([
                f.get_tensor(tensor_key(v.key, key)) if v.stateful
                else torch.zeros(tensor_shape(v, spec), dtype=spec.dtype) for v in virtuals])
    return merged


# ---- inspect --------------------------------------------------------------------------------


@dataclass
class InspectReport:
    lines: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def inspect(folder: str | os.PathLike[str], *, verify_shards: bool = False) -> InspectReport:
    """The manifest in human terms; with ``verify_shards``, every shard's size, sha256, tensors."""
    report = InspectReport()
    try:
        path, manifest = open_checkpoint(folder)
    except CheckpointError as e:
        report.problems.append(str(e))
        return report
    raw, n = manifest.raw, manifest.group_size
    total = sum(int(s["bytes"]) for s in manifest.shards)
    report.lines += [
        f"selzero checkpoint {path}",
        f"  format {raw['format_version']}, written by selzero {raw.get('package_version')}, "
        f"instance {raw.get('name')!r}",
        f"  group size {n} rank(s); {len(manifest.shards)} shard(s), {_size(total)}"
        + (f"; expert-parallel rank {manifest.expert_parallel[0]} of "
           f"{manifest.expert_parallel[1]}" if manifest.expert_parallel else ""),
        f"  optimizer {manifest.optimizer_class}",
    ]
    if manifest.partition == "tensors":
        report.lines.insert(3, "  partition: tensors (whole tensors, each in its owner's shard); "
                            + _ownership_line(manifest))
    classes = manifest.group_classes
    for g, (hyper, specs) in enumerate(zip(manifest.group_hyper, manifest.group_state)):
        count = len({v.entry for v in manifest.virtuals if v.group == g})
        if manifest.partition == "tensors":
            specs = {k: s for v in manifest.virtuals if v.group == g
                     for k, s in state_specs(manifest, v).items()}
        state = ", ".join(f"{k} ({s.kind})" for k, s in sorted(specs.items())) or "none"
        own = f" ({classes[g]})" if classes[g] != manifest.optimizer_class else ""
        report.lines.append(f"    group {g}{own}: {count} parameter(s); "
                            f"{', '.join(f'{k}={v}' for k, v in sorted(hyper.items()))}; "
                            f"state: {state}")
    norm = raw.get("normalization", {})
    report.lines.append("  normalization: " + ", ".join(f"{k}={v}" for k, v in norm.items()))
    report.lines += _parameter_lines(path, manifest)
    if verify_shards:
        problems = verify(path, manifest)
        report.problems += problems
        if not problems:
            report.lines.append(f"  verify: OK, {n} shard(s) complete (size, sha256, tensors)")
    return report


def _ownership_line(manifest: Manifest) -> str:
    """Elements and optimizer cost per owner ([Note: ownership plan])."""
    from ..core.ownership import balance, optimizer_cost

    n = manifest.group_size
    classes = manifest.group_classes
    costs = [optimizer_cost(classes[v.group], manifest.group_hyper[v.group], v.shape)
             for v in manifest.virtuals]
    owners = [v.owner or 0 for v in manifest.virtuals]
    elements = [0] * n
    for v in manifest.virtuals:
        elements[v.owner or 0] += v.numel
    return (f"elements per rank {elements}, optimizer-work balance (max/mean) "
            f"{balance(costs, owners, n):.3f}")


def _parameter_lines(path: Path, manifest: Manifest) -> list[str]:
    steps = _steps(path, manifest)
    trainable = {v.entry for v in manifest.virtuals}
    frozen = [e for e in manifest.entries if e["frozen"]]
    numel = sum(v.numel for v in manifest.virtuals)
    stateful = sum(v.stateful for v in manifest.virtuals)
    lines = [f"  parameters: {len(manifest.entries)} selected ({len(trainable)} trainable, "
             f"{len(frozen)} frozen), {len(manifest.virtuals)} virtual, {numel:,} elements; "
             f"optimizer state for {stateful} of {len(manifest.virtuals)}"]
    if steps:  # never stepped: no state (Muon keeps no step count: review finding)
        lines.append(f"  step: {max(steps.values())} (most-stepped parameter; fewest "
                     f"{min(steps.values())}, never stepped: "
                     f"{len(manifest.virtuals) - stateful})")
    width = max((len(e["name"]) for e in manifest.entries), default=0)
    for e in manifest.entries:
        shape = "(" + ", ".join(map(str, e["shape"])) + ")"
        notes = []
        if e["frozen"]:
            notes.append("frozen (no state, value not saved)")
        if e["aliases"]:
            notes.append("aliases " + ", ".join(e["aliases"]))
        if e["experts"]:
            mine = [steps.get(v.key) for v in manifest.virtuals if v.entry == e["name"]]
            counts = [s for s in mine if s is not None]
            stateful = any(v.stateful for v in manifest.virtuals if v.entry == e["name"])
            span = (f"steps {min(counts)}..{max(counts)}" if counts else
                    "optimizer state, no step count kept" if stateful else "never stepped")
            notes.append(f"{e['experts']} experts, {span}"
                         + (f", {len(mine) - len(counts)} never stepped" if 0 < len(counts)
                            < len(mine) else ""))
        elif not e["frozen"]:
            key = next(v.key for v in manifest.virtuals if v.entry == e["name"])
            stateful = next(v.stateful for v in manifest.virtuals if v.entry == e["name"])
            notes.append(f"step {steps[key]}" if key in steps else
                         "has optimizer state (no step count kept)" if stateful else "never stepped")
        lines.append(f"    {e['name']:<{width}}  {shape:<14} {e['dtype']:<9} {'; '.join(notes)}")
    return lines


def _steps(path: Path, manifest: Manifest) -> dict[str, int]:
    """Each stepped virtual parameter's ``step`` state, read from the first shard holding it."""
    n = manifest.group_size
    out: dict[str, int] = {}
    readers: dict[int, LazyShard] = {}
    try:
        for v in manifest.virtuals:
            if not v.stateful or "step" not in state_specs(manifest, v):
                continue
            owner = next(r for r in range(n) if piece_range(manifest, v, r)[1] > 0)
            if owner not in readers:
                readers[owner] = LazyShard(path / shard_file_name(owner, n))
            try:
                out[v.key] = int(readers[owner].read(tensor_key(v.key, "step")))
            except Exception:  # noqa: BLE001 - a damaged shard: --verify reports it
                continue
    finally:
        for reader in readers.values():
            reader.close()
    return out


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    raise AssertionError


# ---- command-line handlers (cli.py parses, these act) ---------------------------------------


def inspect_root(root: Path, *, verify_shards: bool) -> InspectReport:
    """The layout of a selzero folder (index.json), then each instance."""
    from .host import read_index

    report = InspectReport()
    try:
        index = read_index(root, root=True)
    except CheckpointError as e:
        report.problems.append(str(e))
        return report
    report.lines.append(f"selzero folder {root}: saved by {index.get('world_size', '?')} "
                        f"rank(s), {len(index['instances'])} instance(s)")
    for family, info in sorted(index.get("families", {}).items()):
        if info.get("ep_size") is None:
            report.lines.append(f"  {family}: no expert parallelism")
        else:
            keyed = "by global expert (reshardable to another --ep-size)" \
                if info.get("by_global_expert") else \
                "by local name (tied to this expert-parallel size: declare expert_offset)"
            report.lines.append(f"  {family}: expert-parallel size {info['ep_size']}, keyed "
                                f"{keyed}")
    for d in index["instances"]:
        held = "; ".join(f"{c} experts " + ", ".join(f"{a}..{b - 1}" for a, b in runs)
                         for c, runs in sorted(d.get("experts", {}).items()))
        where = f"expert-parallel rank {d['ep_rank']}, " if d.get("ep_rank") is not None else ""
        report.lines.append(f"  instance {d['name']}: {where}ranks {d['ranks']}"
                            + (f"; {held}" if held else ""))
    for d in index["instances"]:
        sub = inspect(root / d["name"], verify_shards=verify_shards)
        report.lines += ["", *sub.lines]
        report.problems += sub.problems
    return report


def _located(folder: str, tool: str) -> str:
    """[checkpoint/locate.py]: a parent folder holding one checkpoint stands for it."""
    from .locate import locate

    found = locate(folder, tool=tool)
    if found != Path(folder):
        print(f"selzero {tool}: the checkpoint in {folder} is {found}", file=sys.stderr)
    return str(found)


def run_inspect(folder: str, *, verify_shards: bool) -> int:
    from .relayout import find_root

    try:
        folder = _located(folder, "inspect")
    except CheckpointError as e:
        print(f"selzero inspect: error: {e}", file=sys.stderr)
        return 1
    found = find_root(Path(folder))
    report = inspect_root(found[0], verify_shards=verify_shards) if found is not None else \
        inspect(folder, verify_shards=verify_shards)
    try:
        for line in report.lines:
            print(line)
        for problem in report.problems:
            print(f"PROBLEM: {problem}")
        sys.stdout.flush()
    except BrokenPipeError:  # `selzero inspect ... | head`: the reader has seen enough
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 1 if report.problems else 0


def _return_freed_buffers_to_the_os() -> None:
    """glibc raises its mmap threshold each time a large buffer is freed, after which buffers
    of that size come from the heap and, freed, stay in the process: a tool that frees one
    tensor after another then grows by tens of MiB. A fixed threshold keeps every buffer of
    1 MiB or more in its own mapping, returned to the OS when freed. (CLI processes only.)"""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass  # not glibc: nothing to tune


def run_reshard(folder: str, *, world_size: int, out: str, ep_size: int | None = None,
                force: bool = False) -> int:
    """An instance folder (manifest.json): its group size becomes ``world_size``. A selzero
    folder (index.json), or a host checkpoint holding one: every instance, for ``world_size``
    ranks and expert-parallel size ``ep_size`` ([Note: relayout] in relayout.py)."""
    from .relayout import find_root, reshard_root

    _return_freed_buffers_to_the_os()
    try:
        folder = _located(folder, "reshard")
        found = find_root(Path(folder))
        _check_out(Path(folder), found, Path(out), force)
        if found is None:
            if ep_size is not None:
                raise CheckpointError(
                    f"{folder}: --ep-size needs the selzero folder of the checkpoint (the "
                    "selected_zero2 folder holding index.json, or the checkpoint above it); "
                    "this is one instance's folder.")
            written = reshard(folder, world_size, out)
            print(f"wrote {written} for a group of {world_size} rank(s)")
            return 0
        root, host = found
        target = Path(out) / "selected_zero2" if host else Path(out)
        written = reshard_root(root, world_size, ep_size, target, force=force)
    except (CheckpointError, OSError) as e:
        print(f"selzero reshard: error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {written} for {world_size} rank(s)"
          + (f", expert-parallel size {ep_size}" if ep_size else ""))
    print(WHERE_IT_GOES.format(new=written.parent if written.name == "selected_zero2" else
                               Path(out), source=root.parent, folder=written))
    return 0


WHERE_IT_GOES = (
    "Where it must go: a run resumes selzero's state from `selected_zero2/` inside the checkpoint "
    "it loads. HF Trainer: `resume_from_checkpoint=NEW` needs the Trainer's own files beside it "
    "(`find {source} -maxdepth 1 -type f -exec cp {{}} {new}/ \\;`; beside DDP they do not "
    "depend on the world size). DeepSpeed: `{new}` is a tag folder (`engine.load_checkpoint(DIR, "
    "tag=...)` with it inside DIR); DeepSpeed's own ZeRO files depend on the world size and are "
    "DeepSpeed's to convert. Accelerate: `accelerator.load_state(NEW)` with the host's files "
    "beside it. selzero wrote {folder} only.")


def _check_out(source: Path, found: Any, out: Path, force: bool) -> None:
    """``--out`` must be a new folder (or ``--force``), and never the checkpoint being read."""
    src = (found[0] if found else source).resolve()
    dest = out.resolve()
    if dest == src or src in dest.parents or dest in src.parents:
        raise CheckpointError(
            f"--out {out}: it overlaps the checkpoint being read ({src}); write to a new folder "
            "and move it into place afterwards.")
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not force:
        raise CheckpointError(
            f"--out {out}: exists and is not empty. Choose a new folder, or pass --force to "
            "replace it (the old one is removed only once the new one is complete).")


def run_consolidate(folder: str, *, out: str, torch_state_dict: str | None,
                    torch_optim_state: str | None = None) -> int:
    _return_freed_buffers_to_the_os()
    try:
        folder = _located(folder, "consolidate")
        written = consolidate(folder, out, torch_state_dict=torch_state_dict,
                              torch_optim_state=torch_optim_state)
    except (CheckpointError, OSError, RuntimeError) as e:  # torch.save: RuntimeError
        print(f"selzero consolidate: error: {e}", file=sys.stderr)
        return 1
    extra = [p for p in (torch_state_dict, torch_optim_state) if p]
    print(f"wrote {written}" + "".join(f" and {p}" for p in extra))
    return 0
