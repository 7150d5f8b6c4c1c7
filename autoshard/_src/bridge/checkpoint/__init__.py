"""`autoshard.save` / `autoshard.restore`: checkpoints that move between meshes and plans, atomic on disk."""
