"""TensorRT-LLM (PyTorch backend): the LLM-API field lists we validate against and the options we write."""
