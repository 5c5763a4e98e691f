"""Sharded data parallelism: flat padded shards (``flat_shards``), ZeRO stages 1-3 on them (``zero``),
and process groups from a grid of ranks (``mesh``)."""
