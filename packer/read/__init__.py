"""Dataset -> PyTorch: the Dataset, read-ahead, samplers, the RAM cache, loaders."""
