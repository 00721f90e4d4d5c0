"""``python -m addnorm``: the ``addnorm`` command line."""

import sys

from addnorm.tools.cli import main

sys.exit(main())
