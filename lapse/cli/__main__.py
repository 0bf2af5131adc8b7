"""`python -m lapse.cli` runs the command line, as the `lapse` script does."""

import sys

from lapse.cli.main import main

sys.exit(main())
