"""Alembic environment and versions of the moegate schema (run them with ``moegate db upgrade``)."""
