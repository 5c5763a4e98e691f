"""Tensor (channel) parallelism: Megatron's f/g and the sequence-parallel pair (``mappings``), column-
and row-parallel layers and channel-split convolutions (``layers``), MLP, attention and a transformer
layer built from them (``blocks``)."""
