"""Wire models (pydantic, OpenAI shapes); converted to engine dataclasses in one place."""
