"""The `poseidon` command line (see tools/cli.py)."""
