#!/usr/bin/env bash
# Downloads the wheels of the gateway's Python packages that the Batch API benchmarks need (the
# policy database's SQLAlchemy, Alembic and drivers, msgspec, the openai client with pydantic and
# what they depend on, including the newer anyio, idna and typing_extensions they need), and the
# engine's own packages the GPU image lacks (msgspec, llguidance for structured output,
# openai-harmony for gpt-oss's chat format; jsonschema and its needs for the structured-output tests; compressed-tensors
# and loguru, the INT4 experts' tests' reference) into .whl/, for installing them on a GPU machine that has Python and
# torch but not these packages,
# and cannot fetch them itself (no network, or no package index). Each wheel is the version
# installed in this checkout's .venv, so the GPU machine runs the same versions as this checkout.
#
# Run it from the repository root, on a machine with network access, pip and the .venv, before
# benchmarks/gpu_session.sh (which installs .whl/*.whl itself, first, when the folder is there). Or copy
# .whl/ to the GPU machine and install the wheels by hand, into a folder of their own put on PYTHONPATH (the
# machine's own packages stay as they are; --no-deps: the list below is complete, nothing else is
# looked for):
#
#   benchmarks/device_wheels.sh
#   # on the GPU machine, in the copied repository (SITE: any folder):
#   SITE=$HOME/moegate-site
#   python3 -m pip install -q --no-index --no-deps --upgrade --target "$SITE" .whl/*.whl
#   export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
#
# .whl/ is added to the checkout's .git/info/exclude, so the wheels never show up as files to commit.
set -eu
PACKAGES="SQLAlchemy greenlet aiosqlite alembic Mako openai httpx2 pydantic pydantic_core annotated-types
typing-inspection jiter sniffio psycopg psycopg-binary asyncpg msgspec httpcore2 truststore typing_extensions anyio idna
llguidance openai-harmony jsonschema jsonschema-specifications referencing rpds-py compressed-tensors loguru"
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
grep -qx "/.whl/" "$exclude" 2>/dev/null || echo /.whl/ >> "$exclude"
mkdir -p .whl
for name in $PACKAGES; do
    version=$(.venv/bin/python -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name")
    # For the GPU machine, not this one: CPython 3.12 on x86_64 Linux (edit these for another target).
    # pip matches platform tags exactly, so every manylinux tag a wheel may be published under is named
    # (llguidance's newer wheels are tagged manylinux_2_3x only).
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_39_x86_64 --platform manylinux_2_35_x86_64 --platform manylinux_2_34_x86_64 \
        --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
        --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform manylinux1_x86_64 \
        -d .whl "$name==$version"
done
ls .whl
du -sh .whl
