"""fleetserve.metrics."""
