"""Checks of the forward against the official reference's fixtures (`golden`: golden-check)."""
