"""fleetserve.cluster."""
