"""The HTTP front, its request policy, ops endpoints, metrics and fleet configuration."""
