"""Run: llama-server as a child process, its supervisor, systemd and the service loop of `up`."""
