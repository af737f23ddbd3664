"""``python -m memfit ...`` (also what torchrun starts: ``torchrun ... -m memfit train CFG``)."""

from memfit.cli import main
from memfit.dist import exit_process

exit_process(main())
