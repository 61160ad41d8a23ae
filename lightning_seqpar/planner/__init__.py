"""What fits, and how to run it: the decoder's sizes (``model_shape.py``), the per-rank memory estimate and its
planner (``memory.py``), the mesh sizes, ``attention="auto"`` and ``memory="auto"`` under the strategy
(``planning.py``), a step planned across nodes (``step_plan.py``). Pure functions: no process group, no GPU."""
