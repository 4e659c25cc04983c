"""The command-line interface: the only layer that prints or exits. One module per command."""
