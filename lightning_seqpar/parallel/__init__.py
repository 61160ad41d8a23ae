"""The strategy's internals, below the planner: its options (``config.py``), the mesh (``mesh.py``), the ``apply_*``
functions (``parallelize.py``) and activation checkpointing (``activation_checkpointing.py``), precision
(``precision.py``), checkpoint files (``checkpoint_io.py``), what a run holds and gives back (``resources.py``), a
collective's failure named (``collective_failures.py``) and the backward thread's handles (``cuda_warmup.py``)."""
