"""Pipeline runtimes (SPMD: runtime, ticks, layouts, repack; MPMD: mpmd, submeshes) and how a step is cut in stages."""
