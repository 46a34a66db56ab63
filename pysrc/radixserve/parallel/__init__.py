"""Tensor parallelism in one process (issue 37): the rank group, its collectives and the rank
worker threads (group.py). The model-level pieces that use them are in
model/tensor_parallel.py."""
