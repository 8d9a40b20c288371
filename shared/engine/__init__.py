"""Strata serving engine: block manager, scheduler, sampler, model runner and the step loop.

The block manager and the scheduler are plain deterministic Python (no torch); the model runner
owns the tensors. ``LLMEngine`` ties them together; ``AsyncEngine`` runs it off the event loop.
"""
