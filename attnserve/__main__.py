"""`python -m attnserve COMMAND ...`: the same as the `attnserve` command."""

import sys

from attnserve.cli import main

sys.exit(main())
