"""Clients: the gRPC client, the load generator and bench, chat, and the quick start."""
