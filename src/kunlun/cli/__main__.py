"""``python -m kunlun.cli``: the same as ``kunlun-cli`` (used to call this installation's CLI
from a subprocess, as the validation battery does for the batch runner)."""

from kunlun.cli.main import main

main()
