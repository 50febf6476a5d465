"""The Batch API: ``/v1/files`` (files), ``/v1/batches`` (batches), the input file's validation, the
runner that feeds batch lines to the engine on idle capacity, and ``moegate run-batch`` (offline)."""
