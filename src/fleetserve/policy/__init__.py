"""fleetserve.policy."""
