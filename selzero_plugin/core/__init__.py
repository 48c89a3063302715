"""The engine, host-agnostic: it never imports a host adapter or the checkpoint code."""
