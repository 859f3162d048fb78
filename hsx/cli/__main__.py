"""``python -m hsx.cli``: the ``hsx`` command."""

import sys

from hsx.cli.main import main

sys.exit(main())
