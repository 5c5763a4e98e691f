"""Layer 4, strategies: one subpackage per way of splitting training across devices
(``data``, ``pipeline``, ``tensor``, ``sharded``)."""
