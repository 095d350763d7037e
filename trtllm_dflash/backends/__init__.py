"""Serving backends other than the embedded PyTorch one; each knows its engine's configuration format."""
