"""CLI subcommands; each module defines ``add_parser(subparsers)``."""
