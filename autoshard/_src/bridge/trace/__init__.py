"""How a user's step is traced into an OpGraph and how its arguments and its loss are understood."""
