"""Context parallelism: a long sequence split over ranks. ``ring`` (ring attention: key/value blocks
travel around the ring, merged with an online softmax; the zig-zag split for causal masks) and
``ulysses`` (an all-to-all turns the sequence split into a head split)."""
