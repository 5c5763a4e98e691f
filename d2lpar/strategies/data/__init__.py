"""Data parallelism: by hand on k devices (``data_parallel``), ``nn.DataParallel`` from inside
(``nn_dataparallel``), DDP by hand with buckets and hooks (``ddp``), gradient accumulation with
``no_sync`` checked by the all-reduces it skips (``accumulation``), and DDP's measurements
(``ddp_timing``)."""
