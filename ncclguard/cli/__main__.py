"""``python -m ncclguard.cli``: the admin CLI."""

from ncclguard.cli import main

main()
