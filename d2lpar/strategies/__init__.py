"""Layer 4, strategies: one module per way of splitting training across devices."""
