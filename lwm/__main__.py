"""`python -m lwm` runs the `lwm` command line."""

from lwm.cli import main

raise SystemExit(main())
