"""``python -m kunlun.engine.native``: build the compiled decode path for this machine."""

from kunlun.engine.native import main

main()
