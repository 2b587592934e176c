"""Benchmarks of the layer stream cache: the longest context a live server holds."""
