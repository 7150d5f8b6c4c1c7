"""A plan turned into jax: NamedSharding pytrees, a sharding-constrained jitted step, planned remat."""
