"""moegate tenants package."""
