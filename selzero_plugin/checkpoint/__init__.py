"""selzero's checkpoints: per-rank safetensors shards plus a JSON manifest, put in place
atomically; offline reshard / consolidate / inspect (tools.py).

Importing this package registers it as the engine's checkpoint reader and writer
(``SelectedZero2.save_checkpoint`` / ``load_checkpoint``): the engine never imports it.
"""

from __future__ import annotations

import os

from ..core.view import ShardView
from ..core.zero2 import register_checkpoint_io
from .format import (CHUNKING, FORMAT, FORMAT_VERSION, Manifest, VirtualRecord, chunk_range,
                     read_manifest, resolve_folder, shard_file_name, tensor_key, virtual_key)
from .load import load_checkpoint
from .save import save_checkpoint

__all__ = ["save_checkpoint", "load_checkpoint", "CHUNKING", "FORMAT", "FORMAT_VERSION",
           "Manifest", "VirtualRecord", "chunk_range", "read_manifest", "resolve_folder",
           "shard_file_name", "tensor_key", "virtual_key"]


class _CheckpointIO:
    def save(self, view: ShardView, folder: str | os.PathLike[str]) -> None:
        save_checkpoint(view, folder)

    def load(self, view: ShardView, folder: str | os.PathLike[str]) -> None:
        load_checkpoint(view, folder)


register_checkpoint_io(_CheckpointIO())
