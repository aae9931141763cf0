"""Parallelisms over one device mesh: dims and mesh, data, tensor, context and pipeline parallel."""
