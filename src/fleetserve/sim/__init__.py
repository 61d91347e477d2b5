"""fleetserve.sim."""
