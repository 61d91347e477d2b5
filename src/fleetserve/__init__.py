"""fleetserve: serve many LLMs on a fleet of GPUs with as little GPU memory as the load needs."""

__version__ = "0.1.0"
