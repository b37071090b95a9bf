"""``python -m llamax.server``: the same as ``llamax serve``."""

from . import main

raise SystemExit(main())
