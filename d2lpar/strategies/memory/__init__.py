"""Memory's levers: activation checkpointing (``checkpointing``), lower precision (``precision``,
``fp8``) and a large model's memory per GPU planned on fake tensors (``dry_run``)."""
