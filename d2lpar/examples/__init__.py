"""Complete scripts that run as they are under ``python``, ``torchrun`` and SLURM.

Start them as modules, which works in any folder wherever d2lpar is installed (a checkout's editable
install or a wheel): ``torchrun --standalone --nproc-per-node=2 -m d2lpar.examples.ddp_torch --out
ckpt``, ``python -m torch.distributed.launch ... -m d2lpar.examples.ddp_torch``, ``srun python -m
d2lpar.examples.ddp_torch``. A file's path (``d2lpar/examples/ddp_torch.py`` in a checkout, or a
copied ``ddp_torch.py``) works too.

* ``ddp_torch.py``: the script to copy. DistributedDataParallel training in one file that imports
  only torch (its docstring says "torch only"; ``tests/test_examples_torch_only.py`` fails if it, or
  any other script marked so, reaches d2lpar). Notebook 07 shows it and runs it under torchrun;
  notebook 08 starts it with every launcher.
* ``train_ddp.py``: the course's version on top of d2lpar (environment detection, atomic
  checkpoints, the digits and LeNet, evaluation without the sampler's padding); notebook 07 trains
  with its ``main`` and evaluates with its ``evaluate``
  (``python -m d2lpar.examples.train_ddp --help``).
"""
