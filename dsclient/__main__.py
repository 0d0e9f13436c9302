"""``python -m dsclient``: the same as the ``dsclient`` command."""

import sys

from .cli import main

sys.exit(main())
