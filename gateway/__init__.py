"""moegate gateway package."""
