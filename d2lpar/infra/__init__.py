"""Layer 1, infrastructure: devices, data, models, timing, plots, checks, paths, worker threads. No torch.distributed."""
