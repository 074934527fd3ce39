"""``python -m gossip.train`` (and ``torchrun -m gossip.train``): :func:`gossip.train.main`."""

import sys

from gossip.train import main

if __name__ == "__main__":
    sys.exit(main())
