"""One thin module per `lwm` verb: `HELP`, `add_arguments(parser)` and `run(args) -> int`."""
