"""A follower rank of a tensor-parallel group (started by rank 0, never by hand).

``python -m kunlun.engine.tp_worker --rank R --world-size N --backend B --init-method
tcp://HOST:PORT --device D`` joins the group on device D, receives the engine settings from rank 0, loads rank R's
slices of the model and runs the steps rank 0 broadcasts
(:func:`kunlun.engine.tp_group.follower_main`). It dies with its parent. Any error is printed
on stderr and exits 1; rank 0's watcher then ends the group.
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kunlun-tp-worker", description=__doc__.split("\n")[0])
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--backend", required=True, help="torch.distributed backend")
    parser.add_argument("--init-method", required=True)
    parser.add_argument("--device", default="cpu", help="this rank's torch device")
    args = parser.parse_args(argv)
    from kunlun.engine.tp_group import follower_main

    try:
        return follower_main(
            args.rank, args.world_size, args.backend, args.init_method, args.device
        )
    except Exception as exc:
        print(f"error: tensor-parallel rank {args.rank}: {type(exc).__name__}: {exc}",
              file=sys.stderr)  # fmt: skip
        return 1


if __name__ == "__main__":
    sys.exit(main())
