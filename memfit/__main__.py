"""``python -m memfit ...`` (also what torchrun starts: ``torchrun ... -m memfit train CFG``)."""

import sys

from memfit.cli import main

sys.exit(main())
