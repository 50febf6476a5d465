"""Tests of tenants/ and migrations/ on SQLite and PostgreSQL."""
