"""Which models this server holds, by name, alias and role, and their lifecycle."""
