"""Click commands, one module per command (group), imported lazily by `mtpwrap.cli`."""
