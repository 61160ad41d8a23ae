"""The Lightning layer above the strategy: ``CausalLMModule`` (``module.py``), ``LitGPTModule`` (``litgpt.py``), the
long-context metrics (``metrics.py``) and callbacks (``callbacks.py``: ``LongContextEval``; ``preemption.py``:
``PreemptionCheckpoint``)."""
