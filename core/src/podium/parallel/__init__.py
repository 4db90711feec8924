"""Tensor parallelism: the model sharded as a transformation (``sharding``, ``layers``), the ranks'
group and plan channel (``group``, ``channel``) and the worker processes (``worker``).
docs/parallelism.md describes the whole."""
