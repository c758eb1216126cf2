"""``python -m waystation.cli``: the ``waystation`` command without its console script."""

from waystation.cli import main

if __name__ == "__main__":
    main()
