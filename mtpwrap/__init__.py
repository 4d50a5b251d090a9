"""mtpwrap: build, size, launch and supervise a llama.cpp MTP server for on-prem use."""

__version__ = "0.1.0"
