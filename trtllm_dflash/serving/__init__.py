"""Serving: the wire contract, the Triton server and its engine model, the OpenAI frontend, the repository writer."""
