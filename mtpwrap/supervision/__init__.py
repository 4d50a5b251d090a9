"""Supervision: llama-server as a child process, its supervisor (states, backoff, wedge watch), KV
carried across restarts, systemd notify and the instance file; the `up` loop is `service`."""
