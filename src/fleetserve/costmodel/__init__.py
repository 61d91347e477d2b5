"""fleetserve.costmodel."""
