"""``python -m megashard`` = the ``megashard`` command line (see megashard/cli/)."""
from megashard.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
