"""torchft's Lighthouse, started fast for the ``--fault-tolerance`` tests.

``python tests/_ftlighthouse.py --min_replicas K --bind [::]:PORT ...`` does what torchft's
``torchft_lighthouse`` does (its Rust ``lighthouse_main`` reads the same flags from the
command line) but loads torchft's compiled extension alone: importing the ``torchft``
package first would import torch, seconds of start-up per Lighthouse on a busy machine.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import sys

if __name__ == "__main__":
    package = os.path.dirname(importlib.util.find_spec("torchft").origin)  # located, not imported
    extension = glob.glob(os.path.join(package, "_torchft*.so"))[0]
    spec = importlib.util.spec_from_file_location("torchft._torchft", extension)
    ext = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ext)
    sys.exit(ext.lighthouse_main())
