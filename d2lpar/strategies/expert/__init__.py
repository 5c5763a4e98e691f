"""Expert parallelism: a mixture-of-experts layer whose experts live on different ranks. ``moe``
(the router, capacity, the auxiliary loss and the single-device layer) and ``dispatch`` (tokens sent
to their expert's rank with an all-to-all and combined back)."""
