"""``python -m dsclient.cli.bench URL ...``: the bench command on its own."""

from . import main

raise SystemExit(main())
