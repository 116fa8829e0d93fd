"""What every layer stands on: partition specs, paths, meshes, caches, private JAX, bytes and tables."""
