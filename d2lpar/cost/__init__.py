"""Layer 5, cost: memory and time of each strategy, from formulas checked against measurements."""
