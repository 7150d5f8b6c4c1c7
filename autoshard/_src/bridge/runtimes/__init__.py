"""Pipeline runtimes beside the SPMD one (`bridge.runtime`): `mpmd` runs each stage as its own jitted
program on its own submesh (stages of any shape), `submeshes` checks and builds those submeshes."""
