"""Strata serving engine: block manager, scheduler, sampler, model runner and the step loop.

The block manager and the scheduler are plain deterministic Python (no torch); the model runner
owns the tensors. ``LLMEngine`` ties them together; ``EnginePort`` (``port.py``) runs it off the
event loop and is, with its types (``port_types.py``) and the request parameters
(``params.py``), all that code outside this package may use.
"""
