"""Layer 4, strategies: one subpackage per way of splitting training across devices
(``data``, ``pipeline``, ``tensor``, ``sharded``, ``context``, ``expert``), and ``memory``, the levers
that make one device's share fit (checkpointing, precision, a fake-tensor dry run)."""
