#!/usr/bin/env bash
# Wheels of the gateway's packages that the lent GPU machines lack (per the device library's
# KINDS.md; and the newer anyio, idna and typing_extensions that openai and pydantic need), at the
# versions in this checkout's .venv, into .whl/ (git-ignored here), for the
# Batch API stages of gpu_session.sh (batch-three-ways, batch-goals).
#
#   benchmarks/device_wheels.sh        # then: run(..., carry=[".whl"]) with a command that starts
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#       --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit;
set -eu
PACKAGES="SQLAlchemy greenlet aiosqlite alembic Mako openai httpx2 pydantic pydantic_core annotated-types
typing-inspection jiter sniffio psycopg psycopg-binary asyncpg msgspec httpcore2 truststore typing_extensions anyio idna"
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
grep -qx "/.whl/" "$exclude" 2>/dev/null || echo /.whl/ >> "$exclude"
mkdir -p .whl
for name in $PACKAGES; do
    version=$(.venv/bin/python -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name")
    # The device's python3 is 3.12 on manylinux x86_64 (KINDS.md); pip matches each platform tag exactly.
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
        -d .whl "$name==$version"
done
ls .whl
du -sh .whl
