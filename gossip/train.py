"""``gossip.train``: the training CLI.

    torchrun --nproc_per_node 8 -m gossip.train --algo ecd --bits 8 --topology ring
    python -m gossip.train --simulate 8 --algo dcd --bits 4 --topology torus

Thin by design: parse and validate the config, build the parts from their registries,
run the loop in :mod:`gossip.loop`, and always tear the process group down. User errors
print one line ``gossip.train: error: ...`` and exit 2 on every rank.
"""

from __future__ import annotations

import os
import sys

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    from gossip.config import ConfigError, parse_args
    from gossip.loop import RunError, run

    rank = int(os.environ.get("RANK", "0"))
    try:
        cfg = parse_args(argv)
        run(cfg)
    except ConfigError as e:
        print(f"gossip.train: error: {e}", file=sys.stderr, flush=True)
        return 2
    except RunError as e:
        print(f"gossip.train: error: {e}", file=sys.stderr, flush=True)
        return e.exit_code
    except KeyboardInterrupt:
        if rank == 0:
            print("gossip.train: interrupted", file=sys.stderr, flush=True)
        return 130
    finally:
        from gossip.comm import shutdown

        shutdown()  # on every path: no native thread of the process group outlives main()
    return 0


if __name__ == "__main__":
    sys.exit(main())
