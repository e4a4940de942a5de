"""A small character-level language model: a user's own training stack, outside hookbench's zoo."""
