"""``python -m ncclguard.cli``: the admin CLI."""

from ncclguard.cli import main

if __name__ == "__main__":
    main()
