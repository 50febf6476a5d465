"""moegate loadgen: load generation and benchmark reports (docs/loadgen.md).

Online, against any OpenAI-compatible server: ``arrivals`` (when requests
leave), ``datasets`` (what they ask), ``client`` (one timed HTTP request),
``scenario`` (tenants and bounds, from YAML/JSON or flags), ``runner`` (runs a
scenario), ``batch_jobs`` (Batch API turnaround), ``records`` (one record per
request), ``metrics`` (numbers from records), ``report`` (console, JSON, CSV),
``report_html`` (plotly pages), ``sweep``, ``progress``. Offline, against the
in-process engine: ``offline``, ``shared_prefix``, ``compare_batching``, on
``bench_model``'s model and workloads. ``cli`` registers ``moegate loadgen
...``. Nothing here imports ``gateway`` or ``tenants``.
"""
