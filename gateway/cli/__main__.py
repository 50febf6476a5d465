"""``python -m gateway.cli``: the ``moegate`` command."""

import sys

from gateway.cli import main

sys.exit(main())
