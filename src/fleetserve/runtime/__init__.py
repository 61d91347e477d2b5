"""The real system: a PyTorch engine, Ray workers, a controller, an HTTP server.

Everything under ``fleetserve.runtime`` may import torch; nothing outside it does
(the simulator and the policies stay torch-free).
"""
