"""Pipeline parallelism: stage partitioners (RaNNC, GraphPipe), schedules, simulator, runtime.

Pure planning code over autoshard's OpGraph/Grouping lives here; only the runtime imports jax.
"""
