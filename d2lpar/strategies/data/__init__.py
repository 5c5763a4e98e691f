"""Data parallelism: by hand on k devices (``data_parallel``), ``nn.DataParallel`` from inside
(``nn_dataparallel``), DDP by hand with buckets and hooks (``ddp``) and its measurements (``ddp_timing``)."""
