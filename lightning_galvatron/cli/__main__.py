"""``python -m lightning_galvatron.cli``: the console script without its launcher."""

import sys

from lightning_galvatron.cli import main

sys.exit(main())
