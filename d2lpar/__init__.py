"""d2lpar: the tested helpers behind the course on parallel and distributed training in PyTorch.

Import the module you need (``from d2lpar.infra import devices``, ``from d2lpar.processes.launch import launch``); importing the package itself is
cheap and pulls in nothing but this docstring and the version.
"""

__version__ = "0.1.0"
