"""Benchmarks behind ``python -m d2lpar bench <name>``: each module has ``main(argv)`` and prints figures."""
