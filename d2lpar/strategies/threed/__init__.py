"""Data x tensor x pipeline parallelism together: a character GPT (``gpt``), the 3D run by hand from
the course's parts (``hand``), and torch's 3D script run from the course (``torch_api``)."""
