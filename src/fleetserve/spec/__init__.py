"""fleetserve.spec."""
