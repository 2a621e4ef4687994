"""`python -m lwm` runs the `lwm` command line."""

from lwm.cli import main

if __name__ == "__main__":  # not in worker processes started by spawn (data.read_processes)
    raise SystemExit(main())
