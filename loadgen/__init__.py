"""moegate loadgen package."""
