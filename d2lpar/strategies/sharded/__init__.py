"""Sharded data parallelism: flat padded shards (``flat_shards``), a sharding wrapper used per module
as FSDP is (``fsdp``), ZeRO stages 1-3 (``zero``, stage 3 built on ``fsdp``), and process groups from
a grid of ranks (``mesh``)."""
