"""Layer 3, communication: collectives by hand with bytes counted, the parameter server, overlap of compute and transfers."""
