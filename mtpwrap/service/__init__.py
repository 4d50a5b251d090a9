"""`mtpwrap up`: the launch decided before anything starts (`startup`), the loop that runs the
supervisor and the front (`server.Service`), reload and restart (`reload`), the entry point
(`up.run_up`)."""
