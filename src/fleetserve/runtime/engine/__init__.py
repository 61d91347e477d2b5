"""The runtime's data plane: a PyTorch LLaMA-family engine (CPU or CUDA).

Import :class:`~fleetserve.runtime.engine.engine.Engine` from
``fleetserve.runtime.engine.engine``; this package stays import-light.
"""
