"""``python -m tools.cli``: the ``loraledger`` console script without installing it."""

from tools.cli import main

main()
