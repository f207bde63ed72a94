"""Model backends: the API talks to models only through ``engine.protocol``."""
