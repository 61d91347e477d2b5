"""fleetserve.workload."""
