"""Reshard a whole selzero folder (``index.json`` and its instances) for another world size and
expert-parallel size: ``selzero reshard FOLDER --world-size W' [--ep-size E'] --out OUT``.

[Note: relayout]
An instance without expert parallelism over the whole world is resharded to a group of W'
ranks (the per-instance reshard of tools.py). An expert-parallel family (one instance per
expert-parallel rank, [Note: checkpoint index]) is regrouped by global expert: for each expert
container with N global experts, expert-parallel rank k' of E' holds the contiguous block
``[k' * N / E', (k' + 1) * N / E')`` (the split of DeepSpeed, Megatron and
``selzero_plugin.moe``; a model declares it with ``expert_offset = k' * N / E'``), sharded over
an expert-data-parallel group of W' / E' ranks ``{k', k' + E', ...}``. A member of a
``ModuleList`` moves whole (its key names its global expert); a fused tensor split with
``expert_dim=0`` is rebuilt with N / E' rows, each expert keyed ``name[expert g]``, so every
expert's value, optimizer state and step count travel unchanged. Changing E' needs every tensor
of the family to carry a global expert index (the index's ``by_global_expert``); keeping E
only regroups each instance for the new expert-data-parallel size.

Streaming: one virtual parameter's tensors at a time, read from the shards of the instance that
holds it and written to the new shards (tools.py, [Note: streaming tools]). Everything is
written into a staging folder next to OUT, the index last, and renamed into place: OUT is
complete or absent.
"""

from __future__ import annotations

import copy
import secrets
import shutil
from pathlib import Path
from typing import Any, Iterator

import torch

from ..errors import CheckpointError
from .atomic import make_staging
from .format import Manifest, VirtualRecord, replan, whats
from .host import FOLDER, INDEX, _write_index, check_layout, instance_record, read_index
from .tools import FullStateReader, open_checkpoint, verify, write_sharded

__all__ = ["find_root", "reshard_root"]


def find_root(folder: Path) -> tuple[Path, bool] | None:
    """(selzero folder holding index.json, whether ``folder`` is the host checkpoint above
    it), or None when ``folder`` holds no index."""
    if (folder / INDEX).is_file():
        return folder, False
    if (folder / FOLDER / INDEX).is_file():
        return folder / FOLDER, True
    return None


def _positive(value: Any, flag: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise CheckpointError(f"{flag} {value!r}: expected a positive integer.")
    return value


def reshard_root(root: Path, world_size: int, ep_size: int | None, out: Path, *,
                 force: bool = False) -> Path:
    """Rewrite the selzero folder ``root`` for ``world_size`` ranks and expert-parallel size
    ``ep_size`` (None: as saved) into ``out`` ([Note: relayout])."""
    world_size = _positive(world_size, "--world-size")
    if ep_size is not None:
        ep_size = _positive(ep_size, "--ep-size")
    index = read_index(root, root=True)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and \
            not (force and (out / INDEX).is_file()):
        raise CheckpointError(f"--out {out}: exists and is not empty; choose a new folder"
                              + (", or pass --force to replace it" if not force else
                                 " (--force replaces a selzero folder only: it holds no "
                                 f"{INDEX})") + ".")
    saved_world = int(index["world_size"]) if "world_size" in index else None
    families: dict[str, list[dict[str, Any]]] = {}
    for d in index["instances"]:
        families.setdefault(d.get("family", d["name"]), []).append(d)
    plans: list[tuple[str, list[int], Manifest, Any]] = []
    for family, members in sorted(families.items()):
        saved_ep = members[0].get("ep_size")
        by_global = index.get("families", {}).get(family, {}).get("by_global_expert", False)
        if saved_ep is None and ep_size is not None and by_global:
            # saved without expert parallelism, every tensor placed: split over ep_size ranks
            if members[0]["ranks"] != list(range(saved_world or 0)):
                raise CheckpointError(f"{root / family}: ran on ranks {members[0]['ranks']}, not "
                                      "the whole world; it cannot be split over expert ranks.")
            plans += _expert_plans(root, family, [{**members[0], "ep_rank": 0}], 1, ep_size,
                                   world_size, True)
        elif saved_ep is None:
            plans.append(_plain_plan(root, members[0], saved_world, world_size))
        else:
            target_ep = ep_size or saved_ep
            plans += _expert_plans(root, family, members, saved_ep, target_ep, world_size,
                                   by_global)
    if ep_size is not None and not any(
            p[2].expert_parallel is not None for p in plans):
        raise CheckpointError(
            f"{root}: --ep-size {ep_size}, but no instance of this checkpoint is keyed by global "
            "expert (saved with expert parallelism, or with expert_offset declared), so there is "
            "nothing to split over expert-parallel ranks. Declare expert_offset in the model "
            "(README, Expert parallelism) and save again, or reshard without --ep-size.")
    save_id = secrets.token_hex(8)  # one save: the index names it, every manifest holds it
    staging = make_staging(out)
    try:
        described = []
        for name, ranks, manifest, stream in plans:
            manifest = Manifest.from_json({**manifest.raw, "save_id": save_id},
                                          where=f"resharded manifest of {name}")
            write_sharded(staging / name, manifest, stream())
            described.append(_described(name, ranks, manifest))
        _write_index(staging, {**check_layout(described, world_size), "save_id": save_id})
        old = None
        if out.exists() and any(out.iterdir()):  # --force: the old one goes once this is whole
            old = out.with_name(f"{out.name}.previous")  # the tools name it if left behind
            if old.exists():
                shutil.rmtree(old)
            out.rename(old)
        elif out.exists():
            out.rmdir()
        try:
            staging.rename(out)
        except BaseException:
            if old is not None and not out.exists():
                old.rename(out)  # the old one back in place: complete or absent, never lost
            raise
        if old is not None:
            shutil.rmtree(old)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out


def _open_valid(root: Path, name: str) -> tuple[Path, Manifest]:
    path, manifest = open_checkpoint(root / name)
    problems = verify(path, manifest)
    if problems:
        raise CheckpointError(f"{path} failed verification; nothing was written: "
                              + " | ".join(problems))
    return path, manifest


def _plain_plan(root: Path, d: dict[str, Any], saved_world: int | None, world_size: int
                ) -> tuple[str, list[int], Manifest, Any]:
    path, manifest = _open_valid(root, d["name"])
    ranks = list(d["ranks"])
    if saved_world is not None and ranks == list(range(saved_world)):
        ranks = list(range(world_size))
    elif saved_world != world_size:
        raise CheckpointError(
            f"{root / d['name']}: instance {d['name']!r} ran on ranks {ranks} of "
            f"{saved_world}, not the whole world, so its place in a world of {world_size} is "
            f"not known; reshard its folder alone (`selzero reshard {root / d['name']} "
            "--world-size M --out NEW`).")
    target = manifest.with_group_size(len(ranks), [])
    return d["name"], ranks, target, lambda: _stream(target, {path: manifest}, {
        v.key: (path, v) for v in manifest.virtuals})


def _expert_plans(root: Path, family: str, members: list[dict[str, Any]], saved_ep: int,
                  target_ep: int, world_size: int, by_global: bool
                  ) -> list[tuple[str, list[int], Manifest, Any]]:
    if world_size % target_ep:
        raise CheckpointError(f"--ep-size {target_ep} does not divide --world-size {world_size}; "
                              "the expert-parallel size must divide the world size.")
    edp = world_size // target_ep
    sources = [_open_valid(root, d["name"]) for d in sorted(members, key=lambda d: d["ep_rank"])]
    manifests = {path: m for path, m in sources}
    first = sources[0][1]
    for path, m in sources[1:]:
        if m.optimizer_class != first.optimizer_class or m.group_state != first.group_state \
                or m.partition != first.partition or m.group_classes != first.group_classes:
            raise CheckpointError(f"{path}: optimizer {m.optimizer_class} with other state keys "
                                  f"than {sources[0][0]} ({first.optimizer_class}); the "
                                  "expert-parallel ranks were built with different optimizers.")
    located = {v.key: (path, v) for path, m in sources for v in m.virtuals}
    plans = []
    if target_ep == saved_ep:  # the same experts on each expert-parallel rank: regroup only
        for k, (path, manifest) in enumerate(sources):
            target = _with_place(manifest, f"{family}-ep{k}", k, target_ep, edp,
                                 manifest.entries, manifest.virtuals)
            own = {v.key: (path, v) for v in manifest.virtuals}  # keys may repeat across ranks
            plans.append((f"{family}-ep{k}", _edp_ranks(k, target_ep, edp), target,
                          _bind(target, {path: manifest}, own)))
        return plans
    if not by_global:
        raise CheckpointError(
            f"{root}: {family!r} was saved without global expert indices (its tensors are keyed "
            "by local names, the same on every expert-parallel rank), so its experts cannot move "
            f"to expert-parallel size {target_ep}. Declare expert_offset in the model "
            "([Note: global expert names], README) and save again; --ep-size may only keep "
            f"{saved_ep} for this checkpoint.")
    blocks = _blocks(root, family, [m for _, m in sources], target_ep)
    for k in range(target_ep):
        entries, virtuals = _regroup(sources, blocks, k)
        target = _with_place(first, f"{family}-ep{k}", k, target_ep, edp, entries, virtuals)
        plans.append((f"{family}-ep{k}", _edp_ranks(k, target_ep, edp), target,
                      _bind(target, manifests, located)))
    return plans


def _edp_ranks(k: int, ep: int, edp: int) -> list[int]:
    return [k + j * ep for j in range(edp)]


def _blocks(root: Path, family: str, manifests: list[Manifest], target_ep: int
            ) -> dict[str, int]:
    """Experts per expert-parallel rank of each container under ``target_ep``."""
    held: dict[str, list[int]] = {}
    for m in manifests:
        for e in m.entries:
            p = e.get("placement")
            if p is None:
                raise CheckpointError(f"{root}: {e['name']!r} of {family!r} has no global expert "
                                      "index; declare expert_offset and save again.")
            held.setdefault(p["container"], []).extend(
                range(int(p["first"]), int(p["first"]) + int(p["count"])))
    blocks = {}
    for container, indices in held.items():
        experts = sorted(set(indices))
        if experts != list(range(len(experts))):
            missing = sorted(set(range(max(experts) + 1)) - set(experts))
            raise CheckpointError(f"{root}: the global experts of {container!r} are not 0..N-1 "
                                  f"(missing {missing[:6]}); every expert of a container must be "
                                  "selected to change the expert-parallel size.")
        if len(experts) % target_ep:
            raise CheckpointError(f"--ep-size {target_ep}: {container!r} has {len(experts)} "
                                  "experts, which do not split evenly; choose an expert-parallel "
                                  f"size that divides {len(experts)}.")
        blocks[container] = len(experts) // target_ep
    return blocks


def _regroup(sources: list[tuple[Path, Manifest]], blocks: dict[str, int], k: int
             ) -> tuple[list[dict[str, Any]], list[VirtualRecord]]:
    """The entries and virtual parameters of expert-parallel rank ``k`` ([Note: relayout])."""
    entries: list[dict[str, Any]] = []
    virtuals: list[VirtualRecord] = []
    emitted: set[str] = set()
    for _, m in sources:
        by_key = m.virtual_by_key
        for e in m.entries:
            p = e["placement"]
            per = blocks[p["container"]]
            lo, hi = k * per, (k + 1) * per
            if p["member"] is not None:  # a ModuleList member: one global expert, whole
                g = int(p["first"])
                if not lo <= g < hi:
                    continue
                entries.append({**e, "local_name": f"{p['container']}.{g - lo}.{p['member']}"})
                if not e["frozen"]:
                    virtuals.append(by_key[e["name"]])
                continue
            if e["name"] in emitted:
                continue
            emitted.add(e["name"])  # a fused tensor: rebuilt with this rank's rows
            entries.append({**e, "shape": [per, *e["shape"][1:]], "experts": per,
                            "placement": {**p, "first": lo, "count": per}})
            if e["frozen"]:
                continue
            for g in range(lo, hi):
                key = f"{e['name']}[expert {g}]"
                found = next((o.virtual_by_key[key] for _, o in sources
                              if key in o.virtual_by_key), None)
                if found is None:
                    raise CheckpointError(f"{key}: held by no expert-parallel rank of the "
                                          "checkpoint; it is incomplete.")
                virtuals.append(found)
    return entries, virtuals


def _with_place(manifest: Manifest, name: str, k: int, ep: int, edp: int,
                entries: list[dict[str, Any]], virtuals: list[VirtualRecord]) -> Manifest:
    raw = copy.deepcopy(manifest.raw)
    raw.update({"name": name, "group_size": edp, "shards": [],
                "expert_parallel": {"ep_rank": k, "ep_size": ep},
                "virtuals": [v.to_json() for v in virtuals]})
    raw["contract"]["entries"] = entries
    if isinstance(raw.get("config"), dict):
        raw["config"]["name"] = name  # as SelectedZero2(group=ExpertGroups) names the instance
    return Manifest.from_json(replan(raw), where=f"resharded manifest of {name}")


def _bind(target: Manifest, manifests: dict[Path, Manifest],
          located: dict[str, tuple[Path, VirtualRecord]]) -> Any:
    return lambda: _stream(target, manifests, located)


def _stream(target: Manifest, manifests: dict[Path, Manifest],
            located: dict[str, tuple[Path, VirtualRecord]]
            ) -> Iterator[tuple[VirtualRecord, str, torch.Tensor]]:
    """The target's tensors in file order, each read from the instance that holds it."""
    readers = {path: FullStateReader(path, m) for path, m in manifests.items()}
    try:
        for v in target.virtuals:
            path, source = located[v.key]
            if whats(target, v) != whats(manifests[path], source):
                raise CheckpointError(f"{v.key}: the saved tensors ({whats(manifests[path], source)}"
                                      f") differ from those planned ({whats(target, v)}).")
            for what, full in readers[path].full(source):
                yield v, what, full
                del full
    finally:
        for reader in readers.values():
            reader.close()


def _described(name: str, ranks: list[int], manifest: Manifest) -> dict[str, Any]:
    return instance_record(name, ranks, manifest.expert_parallel,
                           [e.get("placement") for e in manifest.entries])

