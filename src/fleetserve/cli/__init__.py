"""fleetserve.cli."""
