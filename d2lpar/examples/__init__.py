"""Complete scripts to copy into a project; each runs as it is under ``python``, ``torchrun`` and SLURM.

* ``train_ddp.py``: DistributedDataParallel training with a DistributedSampler, rank-0 logging, an
  atomic checkpoint every epoch and resume on start (``python -m d2lpar.examples.train_ddp --help``).
"""
