"""Tensor parallelism for the native engine: the ranks and their collectives, how the model is split over them,
the worker processes and the channel that hands them each step."""
