"""Decide: hardware, capabilities, profiles, models, the memory plan and the one resolved launch."""
